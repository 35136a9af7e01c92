"""Device and thread set-up of the Python API (flashrt.load) and the run driver."""
import pytest
import torch

import flashrt
from flashrt.errors import DeviceError, FlashrtError
from flashrt.graphs import checkpoint as ckpt
from flashrt.graphs.devices import available_devices, resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(scope="module")
def saved(cfg, weights, tmp_path_factory):
    return ckpt.save(weights, cfg, tmp_path_factory.mktemp("dev") / "tiny")


def test_plain_devices():
    assert resolve_device(None) is None
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(torch.device("meta")).type == "meta"
    assert available_devices()[0] == "cpu"


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_on_a_machine_without_cuda_names_the_devices(device, saved):
    with pytest.raises(DeviceError) as err:
        resolve_device(device)
    msg = str(err.value)
    assert "device:" in msg and ("no CUDA" in msg or "without CUDA" in msg)
    assert "this machine has cpu" in msg and repr(device) in msg
    with pytest.raises(FlashrtError, match="this machine has cpu"):
        flashrt.load(saved, device=device)


@pytest.mark.parametrize("device, words", [
    ("tpu", "expected one of cpu, cuda, npu, meta"), ("cuda:x", "expected one of"), ("", "expected one of"),
    ("mps", "no mps backend"), (3, "expected a device name"),
])
def test_bad_device_names_the_argument(device, words):
    with pytest.raises(DeviceError, match=words):
        resolve_device(device)
    with pytest.raises(ValueError, match="device:"):  # DeviceError is a ValueError too
        resolve_device(device)


def test_run_driver_picks_devices_the_same_way():
    from flashrt.engine.run import pick_device

    assert pick_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceError, match="tpu"):
        pick_device("tpu")


def test_threads(saved):
    before = torch.get_num_threads()
    try:
        flashrt.load(saved, threads=2)
        assert torch.get_num_threads() == 2
        flashrt.load(saved)  # None leaves the setting alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for bad in (0, -3, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads: expected a positive int"):
            flashrt.load(saved, threads=bad)
