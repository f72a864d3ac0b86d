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


def test_the_default_ladder_leaves_amp_out_on_a_cpu_without_native_bf16(tmp_path, monkeypatch):
    import warnings

    import lightning.pytorch as pl

    from lightning_memguard import MemGuardCallback
    from lightning_memguard.mitigations import amp
    from tests.models import BlockStack, trainer_kwargs

    monkeypatch.setattr(amp, "cpu_has_native_bf16", lambda: False)
    default, named = MemGuardCallback(budget="1GiB"), MemGuardCallback(budget="1GiB", mitigations=("amp",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for guard in (default, named):
            pl.Trainer(callbacks=[guard], default_root_dir=str(tmp_path), logger=False,
                       **trainer_kwargs(max_steps=1)).fit(BlockStack(width=32, depth=4))
    assert "amp" not in default.levels and "checkpointing" in default.levels
    assert named.levels == {"amp": 0}  # asked for by name: kept
    said = [str(w.message) for w in caught if "no native bf16" in str(w.message)]
    assert len(said) == 1 and "name 'amp' in mitigations=" in said[0]
