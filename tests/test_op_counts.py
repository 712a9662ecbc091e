"""`sparsecomm.bench.op_counts`: which of the profiler's events are copies between host and device,
and their bytes (the counting of ops and syncs is exercised by the benches' and paths' tests)."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from sparsecomm.bench.op_counts import count_ops, host_device_bytes


def copy(name: str, nbytes: int | None, device_type: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    """A profiler event as torch's structured metadata gives it."""
    return SimpleNamespace(name=name, device_type=device_type,
                           event_metadata=SimpleNamespace(bytes=nbytes) if nbytes is not None else None)


@pytest.mark.parametrize(("event", "expected"), [
    (copy("Memcpy HtoD (Pageable -> Device)", 4096), 4096),
    (copy("Memcpy DtoH (Device -> Pinned)", 512), 512),
    (copy("Memcpy DtoD (Device -> Device)", 4096), 0),  # stays on the device
    (copy("Memset (Device)", 4096), 0),
    (copy("aten::copy_", 4096, DeviceType.CPU), 0),  # the host's op, not the device's copy
    (copy("Memcpy HtoD (Pinned -> Device)", None), 0),  # no metadata recorded
])
def test_only_a_devices_copies_from_and_to_the_host_count(event, expected):
    assert host_device_bytes(event) == expected


def test_a_torch_without_structured_metadata_gives_the_bytes_in_its_text():
    event = SimpleNamespace(name="Memcpy DtoH (Device -> Pageable)", device_type=DeviceType.CUDA,
                            metadata_json='"device": 0, "stream": 7, "bytes": 1024, "memory bandwidth (GB/s)": 2.5')
    assert host_device_bytes(event) == 1024
    assert host_device_bytes(SimpleNamespace(name=event.name, device_type=DeviceType.CUDA, metadata_json="")) == 0
    # structured metadata that left this event's bytes out: the text still has them
    event.event_metadata = SimpleNamespace(bytes=None)
    assert host_device_bytes(event) == 1024


def test_a_step_on_the_host_copies_nothing_between_host_and_device():
    values = torch.ones(1000)
    counted = count_ops(lambda: values.clone().cpu(), 2)
    assert counted.host_device_bytes == 0 and counted.ops >= 1
