"""engine helpers on one gloo rank: unwrap, device, counting."""
import pytest

from mfsdp_kit import engine, runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import GPTSpec, gpt_model_fn


@pytest.fixture(scope="module", params=[False, True], ids=["ddp", "fsdp"])
def chunks(request):
    from tests.dist.launch import free_port
    cfg = EngineConfig(use_megatron_fsdp=request.param)
    runtime.init(cfg, rank=0, world_size=1, master_port=free_port())
    yield engine.build(cfg, gpt_model_fn(GPTSpec(), cfg))
    runtime.shutdown()


def test_unwrap_strips_every_wrapper(chunks):
    from megatron.core.models.gpt import GPTModel
    inner = engine.unwrap_model(chunks)
    assert isinstance(inner[0], GPTModel)
    assert engine.unwrap_model(inner[0]) is inner[0]


def test_module_device(chunks):
    assert engine.module_device(chunks[0]).type == "cpu"


def test_counts_match_spec(chunks):
    assert engine.global_numel(chunks) == GPTSpec().param_count()
    assert engine.local_numel(chunks) == GPTSpec().param_count()  # one rank holds everything


def test_runtime_current_before_init_is_clear():
    runtime.shutdown()
    with pytest.raises(RuntimeError, match="cluster.start"):
        runtime.current()
