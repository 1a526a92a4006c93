"""End-to-end tests of torchtune_offload.assets and the tiny configs that read its output.

Everything is built into pytest's tmp_path; nothing touches ./assets or the network.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config
from torchtune import training
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_sft

import torchtune_offload.assets as tta
from torchtune_offload.assets.__main__ import main
from torchtune_offload.models import TINY_LLAMA_DEFAULTS, tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_EXAMPLES = 200  # small keeps the suite fast; the self-check still runs on it


@pytest.fixture(autouse=True)
def _no_tiktoken_cache(monkeypatch):
    # tiktoken caches ranks by path string; tests must read the file they just wrote.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "assets"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        # check=True: the package's own torchtune self-check must pass as well.
        assert tta.build_assets(output_dir=out, num_examples=NUM_EXAMPLES, check=True) is True
    return out


def _tree_hashes(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _tiny_cfg(name: str, assets: Path):
    """Load configs/tiny/<name>.yaml with its asset paths moved to ``assets``."""
    cfg = OmegaConf.load(REPO_ROOT / "configs" / "tiny" / f"{name}.yaml")
    cfg.tokenizer.path = str(assets / tta.TOKENIZER_FILE)
    cfg.tokenizer.special_tokens_path = str(assets / tta.SPECIAL_TOKENS_FILE)
    cfg.dataset.data_files = str(assets / tta.DATA_FILE)
    cfg.checkpointer.checkpoint_dir = str(assets / tta.MODEL_DIR)
    return cfg


def _load_tiny_state_dict(cfg, tmp_path: Path) -> dict:
    checkpointer = tt_config.instantiate(cfg.checkpointer, output_dir=str(tmp_path / "ckpt_out"))
    return checkpointer.load_checkpoint()[training.MODEL_KEY]


def test_output_is_deterministic(assets, tmp_path):
    again = tmp_path / "again"
    tta.build_assets(output_dir=again, num_examples=NUM_EXAMPLES, check=False)
    first, second = _tree_hashes(assets), _tree_hashes(again)
    assert set(first) == {
        tta.MANIFEST_NAME, tta.DATA_FILE, tta.TOKENIZER_FILE, tta.SPECIAL_TOKENS_FILE,
        f"{tta.MODEL_DIR}/{tta.CONFIG_FILE}", f"{tta.MODEL_DIR}/{tta.WEIGHTS_FILE}",
    }
    assert first == second
    manifest = json.loads((assets / tta.MANIFEST_NAME).read_text())
    assert manifest["content_version"] == tta.CONTENT_VERSION
    for rel, info in manifest["files"].items():
        assert info["sha256"] == first[rel]


def test_seed_changes_content(assets, tmp_path):
    other = tmp_path / "seed1"
    tta.build_assets(output_dir=other, num_examples=NUM_EXAMPLES, seed=1, check=False)
    base, changed = _tree_hashes(assets), _tree_hashes(other)
    assert base[tta.DATA_FILE] != changed[tta.DATA_FILE]
    weights = f"{tta.MODEL_DIR}/{tta.WEIGHTS_FILE}"
    assert base[weights] != changed[weights]


def test_skips_when_current_and_force_rebuilds(assets, capsys):
    before = _tree_hashes(assets)
    assert tta.build_assets(output_dir=assets, num_examples=NUM_EXAMPLES, check=False) is False
    assert "up to date" in capsys.readouterr().out
    assert tta.build_assets(output_dir=assets, num_examples=NUM_EXAMPLES, force=True, check=False)
    assert _tree_hashes(assets) == before


def test_tokenizer_round_trip_and_special_ids(assets):
    cfg = _tiny_cfg("full", assets)
    tok = tt_config.instantiate(cfg.tokenizer)
    vocab_size = TINY_LLAMA_DEFAULTS["vocab_size"]
    assert tok.vocab_size == vocab_size
    special = [tok.bos_id, tok.eos_id, tok.pad_id, tok.step_id, tok.start_header_id,
               tok.end_header_id, tok.eot_id, tok.eom_id, tok.python_tag, tok.image_id]
    assert len(set(special)) == len(special)
    assert all(tok.base_vocab_size <= i < vocab_size for i in special)
    assert max(tok.stop_tokens) < vocab_size
    # Seen and unseen text (bytes fall back to single-byte ranks).
    for text in ["Reverse: a c e", "Capital of France", "Hello, wörld! 123 ✓\n\ttabs"]:
        ids = tok.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert all(0 <= i < tok.base_vocab_size for i in ids[1:-1])
        assert tok.decode(ids) == text
    # The chat template's role names and separator are single trained tokens.
    for piece in ("user", "assistant", "\n\n"):
        assert len(tok.encode(piece, add_bos=False, add_eos=False)) == 1


def test_dataset_from_config_yields_tokens_and_labels(assets):
    cfg = _tiny_cfg("full", assets)
    tok = tt_config.instantiate(cfg.tokenizer)
    ds = tt_config.instantiate(cfg.dataset, tok)
    assert len(ds) == NUM_EXAMPLES
    sample = ds[0]
    assert len(sample["tokens"]) == len(sample["labels"]) <= tta.MAX_EXAMPLE_TOKENS
    # train_on_input=False: prompt positions ignored, the answer is supervised.
    assert CROSS_ENTROPY_IGNORE_IDX in sample["labels"]
    supervised = [t for t in sample["labels"] if t != CROSS_ENTROPY_IGNORE_IDX]
    assert tok.eot_id in supervised and len(supervised) >= 3
    batch = padded_collate_sft([ds[i] for i in range(8)], padding_idx=tok.pad_id)
    assert batch["tokens"].dtype == torch.long and batch["tokens"].shape[0] == 8
    assert batch["tokens"].shape == batch["labels"].shape
    assert int(batch["tokens"].max()) < TINY_LLAMA_DEFAULTS["vocab_size"]


def test_checkpoint_loads_strictly_into_tiny_llama(assets, tmp_path):
    cfg = _tiny_cfg("full", assets)
    hf_config = json.loads((assets / tta.MODEL_DIR / tta.CONFIG_FILE).read_text())
    assert hf_config["hidden_size"] == TINY_LLAMA_DEFAULTS["embed_dim"]
    assert hf_config["num_hidden_layers"] == TINY_LLAMA_DEFAULTS["num_layers"]
    assert hf_config["vocab_size"] == TINY_LLAMA_DEFAULTS["vocab_size"]
    assert hf_config["tie_word_embeddings"] is False
    assert cfg.checkpointer.model_type == "LLAMA3"

    state_dict = _load_tiny_state_dict(cfg, tmp_path)
    model = tt_config.instantiate(cfg.model)
    assert type(model) is type(tiny_llama())
    model.load_state_dict(state_dict, strict=True)
    tokens = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (1, 16, TINY_LLAMA_DEFAULTS["vocab_size"])
    # Small seeded init: predictions start near uniform.
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])
    assert abs(loss.item() - math.log(TINY_LLAMA_DEFAULTS["vocab_size"])) < 0.5


def test_lora_config_model_accepts_checkpoint(assets, tmp_path):
    cfg = _tiny_cfg("lora", assets)
    state_dict = _load_tiny_state_dict(cfg, tmp_path)
    model = tt_config.instantiate(cfg.model)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected
    assert missing and all("lora_" in key for key in missing)


@pytest.mark.parametrize("xdg_cache_home", [None, "/elsewhere/cache"], ids=["home-cache", "xdg-cache"])
def test_configs_point_at_built_assets(xdg_cache_home, monkeypatch):
    """Every tiny config reads the folder ``python -m torchtune_offload.assets`` writes by default."""
    if xdg_cache_home is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg_cache_home)
    tiny = tta.default_tiny_dir()
    assert tiny == Path(xdg_cache_home or Path.home() / ".cache") / "torchtune_offload" / "tiny"
    for path in sorted((REPO_ROOT / "configs" / "tiny").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        assert cfg.tokenizer.path == f"{tiny}/{tta.TOKENIZER_FILE}"
        special_path = f"{tiny}/{tta.SPECIAL_TOKENS_FILE}"
        assert cfg.tokenizer.special_tokens_path == special_path
        assert cfg.dataset.data_files == f"{tiny}/{tta.DATA_FILE}"
        assert cfg.checkpointer.checkpoint_dir == f"{tiny}/{tta.MODEL_DIR}"
        assert list(cfg.checkpointer.checkpoint_files) == [tta.WEIGHTS_FILE]
        assert cfg.tokenizer.max_seq_len >= tta.MAX_EXAMPLE_TOKENS
        assert cfg.device == "cpu" and cfg.dtype == "fp32" and cfg.seed == 0


def test_real_arch_single_layer_loads(tmp_path):
    out = tmp_path / "qwen"
    tta.build_assets(output_dir=out, real_arch="qwen2_5_0_5b", num_layers=1, check=False)
    hf_config = json.loads((out / tta.CONFIG_FILE).read_text())
    assert hf_config["num_hidden_layers"] == 1
    assert hf_config["torch_dtype"] == "bfloat16"
    assert hf_config["tie_word_embeddings"] is True
    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(out), checkpoint_files=[tta.WEIGHTS_FILE], model_type="QWEN2",
        output_dir=str(tmp_path / "ckpt_out"), recipe_checkpoint=None,
    )
    state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
    assert all(v.dtype == torch.bfloat16 for v in state_dict.values())
    model = tta.build_meta_model(real_arch="qwen2_5_0_5b", num_layers=1)
    model.load_state_dict(state_dict, strict=True, assign=True)
    assert model.tok_embeddings.weight.shape == (151936, 896)
    norm_scale = model.layers[0].sa_norm.scale.detach()
    assert torch.equal(norm_scale, torch.ones(896, dtype=torch.bfloat16))


def test_mid_size_llama_checkpoint_loads_into_its_builder(tmp_path):
    out = tmp_path / "mid"
    tta.build_assets(output_dir=out, real_arch="llama3_2_mid", check=False)
    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(out), checkpoint_files=[tta.WEIGHTS_FILE], model_type="LLAMA3_2",
        output_dir=str(tmp_path / "ckpt_out"), recipe_checkpoint=None,
    )
    state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
    model = tta.build_meta_model(real_arch="llama3_2_mid", num_layers=None)
    model.load_state_dict(state_dict, strict=True, assign=True)
    assert 10e6 < sum(p.numel() for p in model.parameters()) < 100e6  # "tens of millions"


def test_bad_input_is_rejected(tmp_path, capsys):
    assert main(argv=["--num-layers", "1", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--num-layers only applies with --real-arch" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not ours")
    with pytest.raises(ValueError, match="not written by this script"):
        tta.build_assets(output_dir=foreign, check=False)
    with pytest.raises(ValueError, match="num-layers 99"):
        tta.build_assets(output_dir=tmp_path / "y", real_arch="llama3_2_1b", num_layers=99)
    assert not (tmp_path / "y").exists()


def test_missing_tiny_assets_names_the_path_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokenizer = f"{tta.default_tiny_dir()}/{tta.TOKENIZER_FILE}"
    message = tta.missing_tiny_assets(paths=[str(tmp_path / "elsewhere.json"), tokenizer])
    # The interpreter running this (a venv's, say, not activated), not whatever `python` PATH finds.
    assert tokenizer in message and f"`{sys.executable} -m torchtune_offload.assets`" in message
    # Paths outside the default folder are the recipe's file checks' business, not this hint's.
    assert tta.missing_tiny_assets(paths=[str(tmp_path / "elsewhere.json")]) is None
    built = tta.default_tiny_dir() / tta.TOKENIZER_FILE
    built.parent.mkdir(parents=True)
    built.write_text("ranks")
    assert tta.missing_tiny_assets(paths=[str(built)]) is None
