"""Smoke test of the demo: a few steps of a tiny model, outputs written."""

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from maxattn import demo  # noqa: E402


def test_demo_smoke(tmp_path, capsys):
    # --clip-only: one compile instead of two (the QK-Clip run is the one with more machinery)
    rc = demo.main(["--clip-only", "--steps", "3", "--layers", "1", "--heads", "2", "--d-model", "16",
                    "--seq-len", "16", "--batch-size", "2", "--threshold", "0.5",
                    "--out-dir", str(tmp_path), "--quiet"])
    assert rc == 0
    png = tmp_path / "maxattn_demo.png"
    assert png.is_file() and png.stat().st_size > 10_000
    data = np.load(tmp_path / "maxattn_demo.npz")
    assert data["QKClip_max_logits"].shape == (3, 1, 2)
    assert "no_QKClip_losses" not in data
    assert np.all(np.isfinite(data["QKClip_losses"]))
    out = capsys.readouterr().out
    assert "plot written to" in out and "QK-Clip" in out and "final loss" in out


def test_demo_args():
    with pytest.raises(SystemExit):
        demo.parse_args(["--no-clip", "--clip-only"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "0"])
    args = demo.parse_args([])
    assert args.out_dir == "demo_out" and args.steps > 0
    assert len(demo.load_corpus()) > 100_000
