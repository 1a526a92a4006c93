"""A crash during a checkpoint save leaves the previous complete checkpoint as it was."""

from pathlib import Path

import pytest
from torchtune.utils import get_logger

from torchtune_offload.recipe.checkpoints.atomic_save import COMPLETE_MARKER, save_atomically


class _Crash(Exception):
    pass


class _FakeCheckpointer:
    """Writes as torchtune's checkpointers do: weights into epoch_<N>/, then recipe_state/recipe_state.pt."""

    def __init__(self, output_dir: Path, crash_after_weights: bool = False) -> None:
        self._output_dir = output_dir
        self.crash_after_weights = crash_after_weights

    def save_checkpoint(self, state_dict, *, epoch, intermediate_checkpoint):
        weights = Path(self._output_dir) / f"epoch_{epoch}" / "model.safetensors"
        weights.parent.mkdir(parents=True, exist_ok=True)
        weights.write_text(state_dict["model"])
        get_logger().info(f"Model checkpoint of size 0.00 GiB saved to {weights}")  # as torchtune's do
        if self.crash_after_weights:
            raise _Crash
        if intermediate_checkpoint:
            state = Path(self._output_dir) / "recipe_state" / "recipe_state.pt"
            state.parent.mkdir(parents=True, exist_ok=True)
            state.write_text(state_dict["recipe"])


def test_a_save_lands_whole_with_a_marker(tmp_path, caplog):
    caplog.set_level("INFO")
    save_atomically(_FakeCheckpointer(tmp_path), {"model": "w0", "recipe": "r0"}, epoch=0,
                    intermediate_checkpoint=True)
    # torchtune's line names where the weights are once they are there, not the staging folder it wrote into.
    assert caplog.messages == [f"Model checkpoint of size 0.00 GiB saved to {tmp_path / 'epoch_0' / 'model.safetensors'}"]
    assert (tmp_path / "epoch_0" / "model.safetensors").read_text() == "w0"
    assert (tmp_path / "epoch_0" / COMPLETE_MARKER).is_file()
    assert (tmp_path / "recipe_state" / "recipe_state.pt").read_text() == "r0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0", "recipe_state"]


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path, caplog):
    caplog.set_level("INFO")
    save_atomically(_FakeCheckpointer(tmp_path), {"model": "w0", "recipe": "r0"}, epoch=0,
                    intermediate_checkpoint=True)
    with pytest.raises(_Crash):
        save_atomically(_FakeCheckpointer(tmp_path, crash_after_weights=True), {"model": "w1", "recipe": "r1"},
                        epoch=1, intermediate_checkpoint=True)
    # The failed save's "saved to" line is not logged: what it says did not happen.
    assert not any("epoch_1" in m for m in caplog.messages), caplog.messages

    assert not get_logger().filters  # and torchtune's logger is left as it was
    # Nothing of the failed save is where a resume looks; the previous state is untouched.
    assert not (tmp_path / "epoch_1").exists()
    assert (tmp_path / "recipe_state" / "recipe_state.pt").read_text() == "r0"
    assert (tmp_path / "epoch_0" / "model.safetensors").read_text() == "w0"
    # Saving again cleans up the crashed attempt and lands whole.
    save_atomically(_FakeCheckpointer(tmp_path), {"model": "w1", "recipe": "r1"}, epoch=1, intermediate_checkpoint=True)
    assert (tmp_path / "recipe_state" / "recipe_state.pt").read_text() == "r1"
    assert (tmp_path / "epoch_1" / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0", "epoch_1", "recipe_state"]


def test_the_checkpointer_keeps_its_destination_after_a_crash(tmp_path):
    ck = _FakeCheckpointer(tmp_path, crash_after_weights=True)
    with pytest.raises(_Crash):
        save_atomically(ck, {"model": "w", "recipe": "r"}, epoch=0, intermediate_checkpoint=False)
    assert ck._output_dir == tmp_path


def test_the_recipes_save_through_it(tiny_assets, tmp_path):
    from tests.recipe.test_recipes import RESUME, run_recipe

    run_recipe("full", tiny_assets, tmp_path, *RESUME)
    assert (tmp_path / "epoch_0" / COMPLETE_MARKER).is_file() and (tmp_path / "epoch_1" / COMPLETE_MARKER).is_file()
    assert not list(tmp_path.glob(".saving_epoch_*"))


def test_torchtunes_misleading_save_lines_are_reworded(tmp_path, caplog):
    # torchtune calls every epoch's save its "final epoch checkpoint" (no recipe state in it), and a
    # LoRA save's adapter config an "Adapter checkpoint".
    class Worded(_FakeCheckpointer):
        def save_checkpoint(self, state_dict, *, epoch, intermediate_checkpoint):
            config = Path(self._output_dir) / f"epoch_{epoch}" / "adapter_config.json"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text("{}")
            get_logger().info(f"Adapter checkpoint of size 0.00 GiB saved to {config}")
            get_logger().info("Saving final epoch checkpoint.")

    caplog.set_level("INFO")
    save_atomically(Worded(tmp_path), {}, epoch=0, intermediate_checkpoint=False)
    assert caplog.messages == [
        f"Adapter config of size 0.00 GiB saved to {tmp_path / 'epoch_0' / 'adapter_config.json'}",
        "Epoch 0's weights are saved (a resume reads the step checkpoints in checkpoints/, not these)."]


def test_a_failed_saves_warnings_are_logged_at_once(tmp_path, caplog):
    # They may say why it failed; only the lines that say what it saved wait for it to succeed.
    class Warns(_FakeCheckpointer):
        def save_checkpoint(self, state_dict, *, epoch, intermediate_checkpoint):
            get_logger().info("saved to somewhere")
            get_logger().warning("disk nearly full")
            raise _Crash

    caplog.set_level("INFO")
    with pytest.raises(_Crash):
        save_atomically(Warns(tmp_path), {}, epoch=0, intermediate_checkpoint=False)
    assert caplog.messages == ["disk nearly full"]
