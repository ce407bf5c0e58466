"""``kvserve generate``: offline generation for one prompt from the command line."""

from __future__ import annotations

import subprocess

import pytest

from e2e_helpers import MODEL, REPO, kvserve_argv

pytestmark = pytest.mark.slow


def test_generate_prints_a_completion() -> None:
    argv = kvserve_argv("generate", "--model", MODEL, "--prompt", "The capital of France is",
                        "--max-tokens", "8", "--dtype", "float32")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    # Logs go to stderr; stdout is the completion alone.
    assert r.stdout.strip(), f"no completion on stdout; stderr:\n{r.stderr}"
    assert "INFO" not in r.stdout, r.stdout
