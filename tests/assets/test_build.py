"""Unit tests of torchtune_offload.assets.build and the command line: manifest, hashes, options."""

from __future__ import annotations

import hashlib
import json

import pytest

import torchtune_offload.assets as tta
from torchtune_offload.assets.__main__ import _OPTIONS, parse_args
from torchtune_offload.models import TINY_LLAMA_DEFAULTS

# sha256 of the default build's files (seed 0, 1000 examples) that do not depend on the CPU:
# data and tokenizer are pure Python, config.json only shapes. The weights come from torch's
# CPU sampler, which may differ between instruction sets, so they are not pinned. A change
# here must come with a CONTENT_VERSION bump.
PINNED_SHA256 = {
    tta.DATA_FILE: "3743a48991b1b35264609fe0e2353c649575e70e020a9cfbbf09f25040080b54",
    tta.TOKENIZER_FILE: "dc1833c43538443a23d57ccb61e1e197c7ce0777d19fbcaf5ec3e944e3d5fa86",
    tta.SPECIAL_TOKENS_FILE: "fce826715a8167eea55345cfa5f2a347071105af99f1d3f349e8ba3de0b12cf0",
    f"{tta.MODEL_DIR}/{tta.CONFIG_FILE}":
        "048a9a91c7f919f35b5d20dcd9bb18dfb9ffebf4acf422b16b0620f6715244a5",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_tiktoken_cache(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")


@pytest.fixture(scope="module")
def default_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("default") / "assets"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        assert tta.build_assets(output_dir=out, check=False) is True
    return out


def test_sha256_file_matches_hashlib(tmp_path):
    path = tmp_path / "blob"
    data = bytes(range(256)) * 20_000  # > one 4 MiB read block
    path.write_bytes(data)
    assert tta.sha256_file(path=path) == hashlib.sha256(data).hexdigest()


def test_default_build_matches_pinned_hashes(default_build):
    manifest = json.loads((default_build / tta.MANIFEST_NAME).read_text())
    for rel, sha in PINNED_SHA256.items():
        assert manifest["files"][rel]["sha256"] == sha, rel
        assert tta.sha256_file(path=default_build / rel) == sha, rel


def test_manifest_records_arguments_and_every_file(default_build):
    manifest = json.loads((default_build / tta.MANIFEST_NAME).read_text())
    assert manifest["content_version"] == tta.CONTENT_VERSION
    assert manifest["generator"] == "scripts/make_tiny_assets.py"  # kept: same bytes as before
    args = manifest["args"]
    assert (args["mode"], args["seed"], args["num_examples"]) == ("tiny", 0, 1000)
    assert args["dtype"] == "fp32" and args["model"] == dict(TINY_LLAMA_DEFAULTS)
    files = sorted(
        p.relative_to(default_build).as_posix() for p in default_build.rglob("*") if p.is_file()
    )
    assert sorted(manifest["files"]) == [f for f in files if f != tta.MANIFEST_NAME]
    for rel, info in manifest["files"].items():
        assert info["bytes"] == (default_build / rel).stat().st_size


def test_damaged_or_interrupted_build_is_redone(tmp_path):
    out = tmp_path / "assets"
    assert tta.build_assets(output_dir=out, num_examples=20, check=False) is True
    data = out / tta.DATA_FILE
    good = data.read_bytes()
    data.write_bytes(good + b"x")  # a size change makes the manifest stale
    assert tta.build_assets(output_dir=out, num_examples=20, check=False) is True
    assert data.read_bytes() == good
    manifest = out / tta.MANIFEST_NAME
    stamp = json.loads(manifest.read_text())
    stamp["files"] = {}  # what an interrupted build leaves behind
    manifest.write_text(json.dumps(stamp))
    assert tta.build_assets(output_dir=out, num_examples=20, check=False) is True
    assert tta.build_assets(output_dir=out, num_examples=20, check=False) is False
    # Other arguments are another build.
    assert tta.build_assets(output_dir=out, num_examples=20, seed=3, check=False) is True


def test_bad_arguments_are_rejected_before_writing(tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="unknown --real-arch"):
        tta.build_assets(output_dir=out, real_arch="gpt2")
    with pytest.raises(ValueError, match="--num-examples must be"):
        tta.build_assets(output_dir=out, num_examples=5)
    with pytest.raises(ValueError, match="unknown --dtype"):
        tta.build_assets(output_dir=out, dtype="fp8")
    with pytest.raises(ValueError, match="--num-layers must be >= 1"):
        tta.build_assets(output_dir=out, real_arch="llama3_2_1b", num_layers=0)
    assert not out.exists()


def test_command_line_options():
    assert list(_OPTIONS) == ["--output-dir", "--seed", "--num-examples", "--real-arch", "--dtype",
                              "--num-layers", "--force", "--no-check"]
    args = parse_args(argv=[])
    assert vars(args) == {"output_dir": None, "seed": 0, "num_examples": 1000, "real_arch": None,
                          "dtype": None, "num_layers": None, "force": False, "no_check": False}
    args = parse_args(argv=["--real-arch", "qwen2_5_0_5b", "--num-layers", "1", "--dtype", "fp16",
                            "--output-dir", "x", "--force", "--no-check", "--seed", "2"])
    assert (args.real_arch, args.num_layers, args.dtype, str(args.output_dir)) == (
        "qwen2_5_0_5b", 1, "fp16", "x")
    assert args.force and args.no_check and args.seed == 2
    with pytest.raises(SystemExit):
        parse_args(argv=["--real-arch", "gpt2"])
