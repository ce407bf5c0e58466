"""bench.kernels prints one row per size it was asked for (its timings are not checked)."""

from __future__ import annotations

import pytest

from bench import kernels
from models import ops

pytestmark = pytest.mark.skipif(not ops.has_int8_dots(), reason="the w4a8 kernels need AVX2 or AVX-512")


def test_tables_have_a_row_per_size(capsys):
    kernels.gemm_table([1, 3], runs=1)
    kernels.attention_table([2], runs=1, context=40, layers=2, blocks=16)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in lines] == ["| rows", "| 1", "| 3", "| sequences", "| 2"]
    assert all("us" in line for line in lines[1:3]) and "ms" in lines[4]


def test_the_gemm_table_has_an_amx_column_where_amx_is_usable(capsys):
    # On software tiles where the CPU has no AMX (the timings mean nothing then).
    if not ops.amx_usable() and not ops.set_amx_emulated(True):
        pytest.skip("neither AMX-INT8 nor AVX512-VNNI to emulate it on")
    try:
        kernels.gemm_table([16], runs=1)
    finally:
        ops.set_amx_emulated(False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "w4a8 on AMX" in lines[0] and lines[1].startswith("| 16 |") and lines[1].count("us") == 4
    assert not ops.amx_enabled()  # left as it was


@pytest.mark.slow
def test_step_table_splits_a_real_decode_step(capsys):
    from bench import step

    step.main(["--sequences", "2", "--context", "20", "--blocks", "64", "--runs", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and rows[0].count("ms") == 5
