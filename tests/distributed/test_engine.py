"""engine helpers on one gloo rank: unwrap, device, counting, the FSDP communication unit, Adam's kernels."""
import pytest
import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed.introspect import is_fsdp
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


def test_fsdp_communication_unit_is_twice_the_mean_layer(chunks):
    """compat.access.fsdp_unit: megatron's own default would be 1e9 elements (a floor, not a cap)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from mfsdp_kit.compat.access import fsdp_unit
    from mfsdp_kit.compat import registry
    if not is_fsdp(chunks[0]):
        return
    inner = chunks[0].module
    layers = [m for m in inner.modules() if isinstance(m, TransformerLayer)]
    mean = sum(p.numel() for m in layers for p in m.parameters()) // len(layers)
    assert inner.suggested_AG_prefetch_size == 2 * mean // 2 and inner.suggested_RS_queue_capacity == 2 * mean
    assert fsdp_unit.PATCH in registry.ACTIVE and fsdp_unit.PATCH.still_needed()


@pytest.mark.parametrize("implementation", ["auto", "foreach", "fused"])
def test_adam_implementation(chunks, implementation):
    """The flags torch's Adam reads at each step; "auto" keeps torch's choice off GPUs. One fused step runs."""
    from mfsdp_kit.distributed.introspect import inner_optimizers
    opt = engine.build_optimizer(chunks, OptimConfig(adam_implementation=implementation), EngineConfig(
        use_megatron_fsdp=is_fsdp(chunks[0])))
    groups = [g for o in inner_optimizers(opt) for g in o.optimizer.param_groups]
    want = {"auto": (None, None), "foreach": (False, True), "fused": (True, False)}[implementation]
    assert {(g.get("fused"), g.get("foreach")) for g in groups} == {want}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron's fp16 optimizer runs on a GPU")
def test_fp16_scales_the_loss_by_the_optimizers_scale_on_a_gpu():
    """fp16 training multiplies the loss by the optimizer's loss scale before the backward (megatron's schedule
    does it through the model config's `grad_scale_func`, which `build_optimizer` sets), so a scale too large
    overflows and the step is skipped, and the unscaled gradient norm does not depend on the scale. Without the
    hook the step divided unscaled gradients by 2**32, and fp16 runs barely moved. A step that overflows at the
    smallest scale raises: no scale would make it finite."""
    from mfsdp_kit.distributed import introspect
    from mfsdp_kit.perf import length_mix
    from mfsdp_kit.train import NonFiniteLossError, step
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    try:
        cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp16", attention_backend="sdpa")
        spec = GPTSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_len_tokens=256)
        chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
        opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-12), cfg)   # the weights all but still
        b = length_mix.batch([(8, 200)] * 4, seq_len_tokens=256, vocab_size=spec.vocab_size)
        norms = []
        for i, scale in enumerate((2.0 ** 40, 2.0 ** 6, 2.0 ** 10)):   # 2**12 nears fp16's max
            for o in introspect.inner_optimizers(opt):
                o.grad_scaler.scale.fill_(scale)
            result = step(chunks, opt, b, micro_batch_size=2, step_index=i)
            assert result.skipped == (i == 0), (i, result)
            norms.append(result.grad_norm)
        assert norms[1] == pytest.approx(norms[2], rel=0.02), norms
        for o in introspect.inner_optimizers(opt):   # an overflow at the smallest scale: no scale helps, so it raises
            o.grad_scaler.scale.fill_(2.0 ** 40)
            o.grad_scaler.min_scale.fill_(2.0 ** 40)
        with pytest.raises(NonFiniteLossError, match="smallest fp16 loss scale"):
            step(chunks, opt, b, micro_batch_size=2, step_index=3)
    finally:
        runtime.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron's fp16 optimizer runs on a GPU")
def test_two_models_of_one_model_fn_each_scale_by_their_own_fp16_optimizer_on_a_gpu():
    """A policy and its critic built by one `model_fn` share one TransformerConfig (`gpt_model_fn` closes over it), so
    the second `build_optimizer` pointed megatron's loss-scale hook at the second optimizer: the first model's loss
    was scaled by the other's scale and unscaled by its own. Each step binds its own optimizer now: with the first's
    scale at 2**40 (an overflow) and the second's at 2**6, the first's step is skipped and the second's is not."""
    from megatron.core.utils import get_model_config
    from mfsdp_kit.distributed import introspect
    from mfsdp_kit.perf import length_mix
    from mfsdp_kit.train import step
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    try:
        cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp16", attention_backend="sdpa")
        spec = GPTSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_len_tokens=256)
        model_fn = gpt_model_fn(spec, cfg)
        models = [engine.build(cfg, model_fn) for _ in range(2)]
        opts = [engine.build_optimizer(m, OptimConfig(lr=1e-12), cfg) for m in models]
        assert get_model_config(models[0][0]) is get_model_config(models[1][0])   # the case: one config
        for opt, scale in zip(opts, (2.0 ** 40, 2.0 ** 6)):
            for o in introspect.inner_optimizers(opt):
                o.grad_scaler.scale.fill_(scale)
        b = length_mix.batch([(8, 200)] * 4, seq_len_tokens=256, vocab_size=spec.vocab_size)
        assert step(models[0], opts[0], b, micro_batch_size=2).skipped   # its own 2**40, not the other's 2**6
        assert not step(models[1], opts[1], b, micro_batch_size=2).skipped
    finally:
        runtime.shutdown()


def test_two_models_of_one_model_fn_each_step_under_their_own_no_sync(chunks):
    """A policy and its critic built by one `model_fn` share one TransformerConfig, whose `no_sync_func` megatron's
    schedule enters around every micro-batch but the last: the second build pointed it at the second model, so the
    first model's steps synced its grads at every micro-batch and toggled the other's sync flags. Each step binds its
    own model's now."""
    from megatron.core.utils import get_model_config
    from mfsdp_kit.perf import length_mix
    from mfsdp_kit.train import step
    cfg = EngineConfig(use_megatron_fsdp=is_fsdp(chunks[0]))
    spec = GPTSpec()
    model_fn = gpt_model_fn(spec, cfg)
    models = [engine.build(cfg, model_fn) for _ in range(2)]
    opts = [engine.build_optimizer(m, OptimConfig(lr=1e-3), cfg) for m in models]
    assert get_model_config(models[0][0]) is get_model_config(models[1][0])   # the case: one config
    entered = []
    for name, m in zip(("policy", "critic"), models):   # each model's no_sync, counted as megatron enters it
        def counted(inner=m[0].no_sync, name=name):
            entered.append(name)
            return inner()
        m[0].no_sync = counted
    b = length_mix.batch([(4, 24)] * 4, seq_len_tokens=spec.seq_len_tokens, vocab_size=spec.vocab_size)
    for name, m, opt in zip(("policy", "critic", "policy"), models + models[:1], opts + opts[:1]):
        entered.clear()
        step(m, opt, b, micro_batch_size=2)
        assert entered == [name]


def test_a_loss_scale_floor_needs_an_fp16_scaler(chunks):
    """bf16 and fp32 optimizers have no dynamic loss scale: never at its floor, nothing read on the host, and no
    loss-scale hook set (`engine.scale_loss_by`)."""
    from megatron.core.utils import get_model_config
    from mfsdp_kit.distributed import introspect
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-3), EngineConfig())
    assert introspect.loss_scale_at_floor(opt) is False
    engine.scale_loss_by(chunks, opt)
    assert get_model_config(chunks[0]).grad_scale_func is None


def test_only_a_dynamic_loss_scale_has_a_floor(chunks):
    """A dynamic fp16 scale is at its floor at its `min_scale` (a step skipped there raises: no scale it can try
    helps). A constant one (megatron's `ConstantGradScaler`: `OptimizerConfig.loss_scale` set) never is: its skipped
    steps are reported and the run goes on, as megatron.training and DeepSpeed do. megatron makes a scaler's tensors
    on CUDA; here the fields its methods read are set on the CPU."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    from mfsdp_kit.distributed import introspect

    def scaler(cls, **fields):
        made = cls.__new__(cls)
        for name, value in fields.items():
            setattr(made, name, torch.tensor([value]))
        return made

    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-3), EngineConfig())
    cases = [(scaler(DynamicGradScaler, _scale=2.0 ** 16, min_scale=1.0), False),
             (scaler(DynamicGradScaler, _scale=1.0, min_scale=1.0), True),
             (scaler(ConstantGradScaler, _scale=1.0), False)]
    for made, at_floor in cases:
        for o in introspect.inner_optimizers(opt):
            o.grad_scaler = made
        assert introspect.loss_scale_at_floor(opt) is at_floor, type(made).__name__
