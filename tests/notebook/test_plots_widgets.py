"""plots write PNGs; the config form shows ConfigError inline and recovers; TrainingPanel updates."""
import matplotlib
import pytest

matplotlib.use("Agg")

from mfsdp_kit.notebook import plots, widgets  # noqa: E402
from mfsdp_kit.config import EngineConfig  # noqa: E402
from mfsdp_kit.distributed.memory import MemoryReport, zero_formula_bytes  # noqa: E402
from mfsdp_kit.train import History, StepResult  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _report(n: int, fsdp: bool) -> MemoryReport:
    num = 100_000
    shard = n if fsdp else 1
    return MemoryReport(params_bytes=4 * num // shard, grads_bytes=4 * num // shard, main_params_bytes=0,
                        optimizer_states_bytes=8 * num // n, activations_peak_bytes=0, num_params=num, dp_size=n)


def test_plots_write_pngs(tmp_path):
    figs = {
        "loss.png": plots.loss_curves({"DDP": [4.9, 2.0, 0.5], "FSDP": [4.9, 2.0, 0.5]}, tmp_path / "loss.png"),
        "reward.png": plots.reward_curve([0.0, 0.1, 0.3, 0.2, 0.6], tmp_path / "reward.png"),
    }
    reports = {"DDP N=2": _report(2, False), "FSDP N=2": _report(2, True).as_dict()}   # object or dict
    formula = {name: zero_formula_bytes(num_params=100_000, dp_size=2, fsdp=name.startswith("FSDP"), dtype="fp32")
               for name in reports}
    figs["memory.png"] = plots.memory_breakdown(reports, formula, tmp_path / "sub" / "memory.png")
    for name, fig in figs.items():
        assert fig.axes, name
        data = (tmp_path / ("sub" if name == "memory.png" else "") / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, name
    # the stacked bars add up to the model state: DDP 4 + 4 + 8/2 = 12 B/param, FSDP 16/2 = 8 B/param
    bars = figs["memory.png"].axes[0].patches
    tops = {round(p.get_x() + p.get_width() / 2): p.get_y() + p.get_height() for p in bars}
    assert tops[0] == pytest.approx(12 * 100_000 / 2**20) and tops[1] == pytest.approx(8 * 100_000 / 2**20)


def test_plots_without_path_return_a_figure():
    fig = plots.loss_curves({"run": [1.0, -0.5]})   # non-positive values: linear axis
    assert fig.axes[0].get_yscale() == "linear"


def test_config_form_shows_the_error_and_recovers():
    form = widgets.config_form(EngineConfig(use_megatron_fsdp=True))
    assert form.error is None and "valid" in form.status.value
    good = form.value
    form.set(tensor_model_parallel_size=0)
    assert "tensor_model_parallel_size=0" in form.error
    assert "color:#c62828" in form.status.value and "tensor_model_parallel_size=0" in form.status.value
    assert form.value == good                       # .value keeps the last valid config
    form.fields["tensor_model_parallel_size"].value = 2   # the user types a fix
    assert form.error is None and form.value.parallelism.tensor_model_parallel_size == 2
    assert form.value.wrapper.use_megatron_fsdp is True


def test_config_form_edits_the_lora_section():
    from mfsdp_kit.lora import LoRAConfig
    form = widgets.config_form(EngineConfig(lora=LoRAConfig(rank=4)))
    assert form.error is None and form.value.lora == LoRAConfig(rank=4)
    form.set(lora='{"rank": 2, "target_modules": ["o_proj"]}')
    assert form.error is None and form.value.lora == LoRAConfig(rank=2, target_modules=["o_proj"])
    form.set(lora="")
    assert form.error is None and form.value.lora is None


@pytest.mark.parametrize("field, value, needle", [
    ("use_distributed_optimizer", False, "use_distributed_optimizer=False"),
    ("override_ddp_config", '{"bucket_sizee": 1}', "bucket_sizee"),
    ("override_ddp_config", "{not json", "JSON object"),
    ("virtual_pipeline_model_parallel_size", "2", "virtual_pipeline_model_parallel_size=2"),
    ("nccl_max_ctas", "eight", "nccl_max_ctas='eight'"),   # an integer-or-None field: a text box, "" = None
    ("lora", '{"rank": 0}', "lora.rank=0"),                  # a section: JSON of its fields, "" = None
    ("lora", '{"rnk": 4}', "lora='{\"rnk\": 4}'"),
])
def test_config_form_names_the_field(field, value, needle):
    form = widgets.config_form(EngineConfig(use_megatron_fsdp=True))
    form.set(**{field: value})
    assert needle in form.error
    form.set(**{field: {"use_distributed_optimizer": True, "override_ddp_config": "{}",
                        "virtual_pipeline_model_parallel_size": "", "nccl_max_ctas": "", "lora": ""}[field]})
    assert form.error is None


def test_config_form_edits_overrides():
    form = widgets.config_form()
    form.set(override_ddp_config={"data_parallel_sharding_strategy": "optim_grads"}, dtype="bf16")
    assert form.error is None
    assert form.value.wrapper.override_ddp_config == {"data_parallel_sharding_strategy": "optim_grads"}
    assert form.value.dtype == "bf16"


def test_training_panel_updates_from_cluster_reports():
    panel = widgets.TrainingPanel([0, 1], show=False)
    for step in (1, 2, 2, 3):   # a poll can see the same step twice
        panel.update({0: dict(step=step, total=3, loss=5.0 / step, tokens_per_s=1000.0),
                      1: dict(step=step, total=3, loss=5.0 / step, tokens_per_s=990.0, memory_bytes=3 * 2**20)})
    assert panel.loss == [5.0, 2.5, 5.0 / 3]
    assert panel.last[1]["memory_bytes"] == 3 * 2**20
    assert "polyline" in panel.widget.value and "3.0 MiB" in panel.widget.value
    assert panel.text(0).startswith("rank 0: step 3/3 loss 1.6667 tokens/s 1000")
    panel.update({0: dict(step=4, total=None, memory_bytes=5)})   # report(total=None) keeps the total
    assert panel.last[0]["total"] == 3
    panel.update({0: dict(step=5, loss_curve=[4.0, 3.0, 2.0, 1.0, 0.5])})   # a StepReporter: every step
    assert panel.loss == [4.0, 3.0, 2.0, 1.0, 0.5]
    assert "loss_curve" not in panel.last[0]


def test_training_panel_from_client_history():
    history = History()
    for i, loss in enumerate([3.0, 2.0, 1.0]):
        history.append(StepResult(loss=loss, grad_norm=1.0, tokens=100, lr=1e-3, step_time_s=0.1))
    panel = widgets.TrainingPanel(show=False)
    panel.update_history(history)
    assert panel.loss == [3.0, 2.0, 1.0] and panel.last[0]["step"] == 3
    panel2 = widgets.TrainingPanel(show=False)
    for i, loss in enumerate(history.loss):   # fit(..., on_step=panel.on_step)
        panel2.on_step(i, StepResult(loss=loss, grad_norm=1.0, tokens=100, lr=1e-3, step_time_s=0.1), total=3)
    assert panel2.loss == panel.loss and panel2.last[0]["memory_bytes"] > 0
    assert "<svg" in panel2._repr_html_()


def test_step_reporter_is_a_noop_off_engines():
    reporter = widgets.StepReporter(total=2)
    reporter(0, StepResult(loss=1.0, grad_norm=1.0, tokens=1, lr=1e-3, step_time_s=0.1))
    assert reporter.losses == [1.0]


def test_step_timeline_one_axis_per_rank(tmp_path):
    from mfsdp_kit.perf.profile import Event
    step = [Event("aten::mm", "compute", 0.0, 0.004, "main", 0), Event("c10d::allgather_", "all_gather", 0.001, 0.0012, "main", 0),
            Event("gloo:all_gather", "all_gather", 0.0012, 0.006, "gloo", 0)]
    fig = plots.step_timeline({"rank 0": step, "rank 1": step[:1]}, tmp_path / "timeline.png")
    assert len(fig.axes) == 2 and (tmp_path / "timeline.png").read_bytes().startswith(PNG_MAGIC)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["compute", "all-gather", "exposed"]


def test_iteration_time_stacks_the_parts_and_mismatch_draws_both_lines():
    from mfsdp_kit.rl.grpo import GRPOHistory
    h = GRPOHistory(sync_s=[0.1, 0.1], rollout_s=[3.0, 2.0], logprob_s=[0.5, 0.5], update_s=[1.0, 1.5],
                    logprob_diff_mean=[1e-7, 2e-7], logprob_diff_max=[1e-6, 3e-6])
    bars = plots.iteration_time(h).axes[0].patches
    tops = {}
    for p in bars:
        x = round(p.get_x() + p.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), p.get_y() + p.get_height())
    assert len(bars) == 8 and tops == pytest.approx({1: 4.6, 2: 4.1})
    floors = [dict(sync_s=0.0, rollout_s=0.4, logprob_s=0.3, update_s=1.0)] * 2
    bars = plots.iteration_time(h, floors=floors).axes[0].patches
    assert len(bars) == 16 and sum(p.get_height() for p in bars if p.get_hatch()) == pytest.approx(2 * 1.7)
    lines = plots.logprob_mismatch(h).axes[0].lines
    assert [list(line.get_ydata()) for line in lines] == [h.logprob_diff_mean, h.logprob_diff_max]


def test_staleness_histogram_sums_the_iterations_and_router_replay_draws_each_setting():
    from mfsdp_kit.rl.loop import History
    h = History(staleness_tokens=[[10], [6, 4], [5, 3, 2]])
    bars = plots.staleness_histogram(h).axes[0].patches
    assert [p.get_height() for p in bars] == [21, 7, 2]
    results = {"fp32": dict(flips=0.0, diff_mean_without=1e-7, diff_max_without=1e-6, diff_mean_with=1e-7,
                            diff_max_with=1e-6),
               "bf16": dict(flips=0.012, diff_mean_without=0.02, diff_max_without=0.9, diff_mean_with=0.01,
                            diff_max_with=0.1)}
    flips, drift = plots.router_replay(results).axes
    assert [p.get_height() for p in flips.patches] == pytest.approx([0.0, 1.2])
    assert sorted(p.get_height() for p in drift.patches) == sorted(v for r in results.values()
                                                                   for k, v in r.items() if k != "flips")


def test_a_figure_is_a_cells_picture_in_a_real_kernel():
    """A bare Figure showed as its text (`<Figure size 640x360 with 1 Axes>`) until a backend was active: plots
    registers IPython's PNG formatter itself, so the first plot of a notebook is a picture."""
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        outputs = []
        kc.execute_interactive("from mfsdp_kit.notebook import plots\nplots.reward_curve([0.1, 0.3])",
                               timeout=120, output_hook=outputs.append)
        shown = [m["content"]["data"] for m in outputs if m["msg_type"] == "execute_result"]
        assert len(shown) == 1 and shown[0]["image/png"], shown
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
