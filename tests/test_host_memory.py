"""Keeping freed host memory: a codec call's temporaries reuse the last call's pages."""

import subprocess
import sys

import pytest

from sparsecomm.host_memory import MAX_MMAP_THRESHOLD, keep_freed_host_memory

FAULTS_PER_ROUND = """
import resource, numpy as np
from sparsecomm.host_memory import keep_freed_host_memory
assert keep_freed_host_memory()
def round_():  # three arrays of 8 bytes per entry at 160k entries, as a codec call builds
    a = np.ones(160_000); b = np.ones(160_000); c = a + b; del a, b, c
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
def test_freed_temporaries_are_reused_without_page_faults():
    # 3 × 1.25 MB of fresh pages would be about 940 faults a round
    faults = float(subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND], check=True, capture_output=True,
                                  text=True).stdout)
    assert faults < 20


def test_out_of_range_settings_are_refused():
    with pytest.raises(ValueError, match="mmap_threshold"):
        keep_freed_host_memory(mmap_threshold=MAX_MMAP_THRESHOLD + 1)
    with pytest.raises(ValueError, match="trim_threshold"):
        keep_freed_host_memory(trim_threshold=-1)
