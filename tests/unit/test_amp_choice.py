import pytest
import torch

from lightning_memguard.mitigations.amp import amp_precision_for


def test_cpu_uses_bf16():
    assert amp_precision_for(torch.device("cpu")) == "bf16-mixed"


@pytest.mark.parametrize("native,expected", [(True, "bf16-mixed"), (False, "16-mixed")])
def test_cuda_uses_bf16_only_where_it_is_native(monkeypatch, native, expected):
    asked = {}

    def is_bf16_supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert amp_precision_for(torch.device("cuda", 0)) == expected
    assert asked["including_emulation"] is False  # emulated bf16 is slow: fp16 with a scaler instead


def test_older_torch_without_the_emulation_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert amp_precision_for(torch.device("cuda", 0)) == "16-mixed"
