"""The benchmarks' CPU-side pieces: JSON and PNG output (with and without matplotlib), and the
CPU host-overhead profile (benchmarks/host_overhead_cpu.py) end to end."""

import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402

ROWS = [{"dtype": dt, "shape": s, "tile_ops": t, "cuBLAS": c, "triton": tr}
        for dt in ("float16", "bfloat16")
        for s, t, c, tr in (("4096x4096x4096", 610.2, 720.5, 650.0), ("64x4096x4096", 90.0, 120.0, None))]


def test_png_without_matplotlib_says_so_and_is_skipped(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = common.png_path_or_none(str(tmp_path / "out.png"))
    assert png is None
    assert "matplotlib is not installed, so no plot will be written" in capsys.readouterr().err
    common.save(ROWS, str(tmp_path / "out.json"), png, ys=("tile_ops", "cuBLAS"))
    assert not (tmp_path / "out.png").exists()
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == ROWS
    assert common.png_path_or_none(None) is None


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    png = common.png_path_or_none(str(tmp_path / "out.png"))
    common.save(ROWS, None, png, x=("dtype", "shape"), ys=("tile_ops", "cuBLAS", "triton"), ylabel="TFLOP/s")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_host_overhead_cpu_runs(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "host_overhead_cpu.py"), "--iters", "20", "--repeat", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["path"]: r["us_per_call"] for r in json.loads(out.read_text())["rows"]}
    assert rows["tile_ops.gemm (fast path)"] > 0 and rows["torch.ops.tile_ops.gemm (dispatcher + plan)"] > 0
