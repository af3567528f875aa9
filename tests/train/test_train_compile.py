"""TrainingOptions(compile=...): torch.compile over the model the step runs. With the eager backend (graph capture
without code generation) a compiled run is bit-identical to the uncompiled one under fastpar's DDP, ZeRO-2 and FSDP
on 2 processes; with Inductor (generated C++ kernels) it trains to the same parameters within float tolerance; the
pipeline strategy and bad values are refused in one line. Also: mixed_precision is 'bf16' or None."""

from __future__ import annotations

import pytest
import test_train as tt
import torch

from fastpar.train import TrainingOptions
from fastpar.user_errors import OptionError


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "zero2", "fsdp"])
def test_compiled_with_the_eager_backend_is_bit_identical(tmp_path, sharding):
    common = dict(ddp="fastpar", sharding=sharding, max_epochs=1)
    plain = tt.fit(tmp_path / "plain", **common)
    compiled = tt.fit(tmp_path / "compiled", compile={"backend": "eager"}, **common)
    tt.assert_same_parameters(compiled.model, plain.model)
    assert [r["loss"] for r in compiled.history] == [r["loss"] for r in plain.history]


@pytest.mark.slow
def test_compiled_with_inductor_trains_to_the_same_parameters(tmp_path):
    common = dict(ddp="fastpar", max_epochs=1)
    plain = tt.fit(tmp_path / "plain", **common)
    compiled = tt.fit(tmp_path / "compiled", compile=True, **common)
    for (name, x), (_, y) in zip(compiled.model.state_dict().items(), plain.model.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"{name}: Inductor's run drifted from eager")
    assert compiled.last("val_accuracy") > 0.6


def test_compile_and_mixed_precision_values_are_checked(tmp_path):
    with pytest.raises(OptionError, match="compile must be True, False or a dict"):
        TrainingOptions(compile="inductor")
    with pytest.raises(OptionError, match=r"torch.compile takes no argument \['backends'\]"):
        TrainingOptions(compile={"backends": "eager"})
    assert TrainingOptions(compile={"backend": "eager", "dynamic": False}).compile == {
        "backend": "eager",
        "dynamic": False,
    }
    with pytest.raises(OptionError, match=r"mixed_precision must be 'bf16', 'fp16' or None \(True means 'bf16'\)"):
        TrainingOptions(mixed_precision="fp8")
    assert TrainingOptions(mixed_precision=True).mixed_precision == "bf16"
    assert TrainingOptions(mixed_precision=False).mixed_precision is None


def test_pipeline_is_not_compiled(tmp_path):
    with pytest.raises(Exception, match="the pipeline strategy runs torch.distributed.pipelining's schedule"):
        tt.fit(tmp_path, sharding="pipeline", compile=True, max_epochs=1, validation_data=None)


def test_the_step_runs_through_dynamo(tmp_path):
    from torch._dynamo.utils import counters

    counters.clear()
    tt.single(tmp_path / "plain", max_epochs=1)
    assert counters["stats"]["unique_graphs"] == 0
    tt.single(tmp_path / "compiled", compile={"backend": "eager"}, max_epochs=1)  # one process: in this one
    assert counters["stats"]["unique_graphs"] >= 1
