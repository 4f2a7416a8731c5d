"""``ray up cluster.yaml`` for real (see ray_up.py beside this file): two nodes over ssh, a put and a get."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ray_up.py")


@pytest.mark.timeout(600)
def test_ray_up_brings_a_working_pool_up_and_tears_it_down() -> None:
    done = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=560)
    output = done.stdout + done.stderr
    if done.returncode == 77:
        pytest.skip(output.strip().splitlines()[-1])
    assert done.returncode == 0, output[-6000:]
    assert "PASSED" in output
    assert "ray stop" not in output.replace("never `ray stop`", "")
