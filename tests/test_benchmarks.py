"""Every benchmark runs at its quick sizes and writes a result file that follows
the format; render_results renders any such file, and the committed ones
render to the committed RESULTS.md.

Not timing tests: they check that each code path runs, that a result file
records its run (machine, load, time, command), and that the agreement checks
inside the benchmarks hold (the optimized log-prob paths match naive; TRL's
loss matches grpo_lab's where the definitions coincide). The TRL comparisons
need the ``bench`` extra.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_DIR = REPO_ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARK_DIR))

import gpu_throughput  # noqa: E402
import harness  # noqa: E402
import logprob_memory  # noqa: E402
import render_results  # noqa: E402

SCRIPTS = {
    "cpu_profile", "logprob_memory", "trl_train_step", "time_to_accuracy",
    "gpu_throughput", "run_cpu", "harness", "threads", "kl_reference",
    "mismatch_bias", "mismatch_learning", "length_bias", "lora", "vllm_cpu", "opd",
    "async_grpo", "notebook_times",
}  # fmt: skip
MACHINE_FIELDS = {
    "nproc", "cpu_model", "torch", "transformers", "torch_threads", "git_commit",
    "load_average_start", "load_average_end", "utc_start", "utc_end",
}  # fmt: skip


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory) -> Path:
    """logprob_memory (in-process) and gpu_throughput at quick sizes, run once."""
    out_dir = tmp_path_factory.mktemp("bench")
    logprob_memory.main(
        ["--quick", "--in-process", "--out", str(out_dir / "logprob_memory.json")]
    )
    gpu_throughput.main(["--quick", "--out", str(out_dir / "gpu_throughput.json")])
    return out_dir


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_records_its_run(result: dict, script: str, flags: list[str]) -> None:
    """The result file passes the schema and says how, where and when it ran."""
    render_results.check_result(result)
    assert result["benchmark"] == script and result["complete"] is True
    # As typed, but with no absolute path of this machine (an --out in tmp_path).
    recorded = [harness.portable_path(flag) for flag in flags]
    assert result["argv"][1:] == [f"benchmarks/{script}.py", *recorded]
    assert not any(os.path.isabs(part) for part in result["argv"])
    assert result["command"] == shlex.join(result["argv"])
    machine = result["machine"]
    assert set(machine) >= MACHINE_FIELDS
    assert machine["torch"] == torch.__version__
    assert machine["utc_start"] <= machine["utc_end"]
    assert len(machine["load_average_end"]) == 3
    assert result["settings"]["quick"] is True
    assert "out" not in result["settings"]


def assert_log_probs_agree(rows: list[dict], tolerance: float) -> None:
    for row in rows:
        for key in (
            "max_abs_diff_log_probs",
            "max_abs_diff_token_entropy",
            "max_abs_diff_head_grad",
            "max_abs_diff_decoder_grad",
        ):
            assert row[key] < tolerance, (row["method"], key, row[key])


def test_logprob_memory_rows_cover_every_method_and_agree(quick_dir):
    out = quick_dir / "logprob_memory.json"
    result = read(out)
    flags = ["--quick", "--in-process", "--out", str(out)]
    assert_records_its_run(result, "logprob_memory", flags)
    (table,) = result["tables"]
    rows = table["rows"]
    methods = ["naive", "default", "chunk=16", "chunk=64"]
    assert [(row["head"], row["method"]) for row in rows] == [
        (head, method) for head in ("frozen", "trainable") for method in methods
    ]
    for row in rows:
        assert row["seconds"] > 0
        assert row["peak_bytes"] >= 0
        assert {"memory_reduction_vs_naive", "time_vs_naive", "peak_mib"} <= set(row)
    assert rows[0]["time_vs_naive"] == rows[4]["time_vs_naive"] == 1.0
    # The default and chunked paths compute the same log-probs, entropies and
    # gradients as log_softmax + gather (float32: rounding only).
    assert_log_probs_agree(rows, 1e-4)
    assert "trainable head, T=64: chunked head" in table["notes"]
    assert "every case in one process" in result["description"]
    assert result["title"] == "Log-prob memory and time (CPU)"


@pytest.mark.slow
def test_logprob_memory_fresh_process_per_case(tmp_path):
    out = tmp_path / "logprob_memory.json"
    result = logprob_memory.main(["--quick", "--heads", "frozen", "--out", str(out)])
    assert read(out) == json.loads(json.dumps(result, default=str))
    rows = result["tables"][0]["rows"]
    assert [row["method"] for row in rows] == [
        "naive",
        "default",
        "chunk=16",
        "chunk=64",
    ]
    assert all(row["peak_bytes"] > 0 for row in rows)
    assert_log_probs_agree(rows, 1e-4)
    assert "fresh process per case" in result["description"]


def test_gpu_throughput_quick_reports_both_head_paths_and_rollouts(quick_dir):
    out = quick_dir / "gpu_throughput.json"
    result = read(out)
    assert_records_its_run(result, "gpu_throughput", ["--quick", "--out", str(out)])
    assert result["peak_flops"] == 989e12
    train, rollouts = result["tables"]
    assert [row["logits_chunk_size"] for row in train["rows"]] == [0, 8]
    for row in train["rows"]:
        # tokens/s is B * T / seconds per step: 4 * 32 tokens here.
        assert row["tokens_per_second"] == pytest.approx(
            4 * 32 / row["seconds_per_step"]
        )
        assert 0 < row["mfu"] < 1
    (rollout,) = rollouts["rows"]
    # 2 rows x 4 new tokens each, every row forced to full length.
    assert rollout["tokens_per_second"] == pytest.approx(2 * 4 / rollout["seconds"])
    assert rollouts["title"].startswith("HF `generate` rollouts")


def test_quick_sets_small_sizes_and_explicit_flags_still_win():
    full = harness.arguments_of(logprob_memory, [])
    assert (full.vocab_sizes, full.heads, full.seed) == ([32000, 151936], ["frozen"], 0)
    quick = harness.arguments_of(logprob_memory, ["--quick"])
    assert (quick.vocab_sizes, quick.heads) == ([512], ["frozen", "trainable"])
    mixed = harness.arguments_of(
        logprob_memory, ["--smoke", "--heads", "trainable", "--seq-lens", "32", "16"]
    )
    assert (mixed.heads, mixed.seq_lens, mixed.vocab_sizes) == (
        ["trainable"],
        [32, 16],
        [512],
    )
    on_gpu = harness.arguments_of(gpu_throughput, ["--quick", "--device", "cuda"])
    assert (on_gpu.device, on_gpu.shape) == ("cuda", "tiny")
    with pytest.raises(SystemExit):  # choices are enforced
        harness.arguments_of(logprob_memory, ["--heads", "thawed"])


def test_flags_take_their_type_from_the_default():
    benchmark = types.SimpleNamespace(
        __file__=str(BENCHMARK_DIR / "made_up.py"),
        __doc__="A benchmark made up for this test.",
        FLAGS={"seeds": [0, 1], "rate": 0.5, "name": "a", "switch": False,
               "overrides": {}, "mode": harness.Flag("x", ("x", "y"))},
        QUICK={},
    )  # fmt: skip
    parsed = harness.arguments_of(
        benchmark,
        ["--seeds", "3", "--rate", "2", "--switch", "--overrides", '{"k": 1}'],
    )
    assert parsed.seeds == [3] and not hasattr(parsed, "seed")
    assert parsed.rate == 2.0 and isinstance(parsed.rate, float)
    assert (parsed.name, parsed.switch, parsed.overrides) == ("a", True, {"k": 1})
    assert parsed.out == BENCHMARK_DIR / "out" / "made_up.json"


def test_main_saves_while_measuring_and_records_the_command(tmp_path, capsys):
    out = tmp_path / "made_up.json"
    seen_on_disk = []

    def measure(arguments, save):
        report = {
            "title": "Made up",
            "description": f"size {arguments.size}",
            "tables": [harness.table([("size", "size")], [{"size": arguments.size}])],
            "notes": "",
        }
        save(report)
        seen_on_disk.append(read(out))
        return report

    benchmark = types.SimpleNamespace(
        __file__=str(BENCHMARK_DIR / "made_up.py"),
        __doc__="A benchmark made up for this test.",
        FLAGS={"size": 8},
        QUICK={"size": 2},
        measure=measure,
    )
    result = harness.main(benchmark, ["--quick", "--out", str(out)])
    (partial,) = seen_on_disk
    assert partial["complete"] is False and result["complete"] is True
    assert read(out)["complete"] is True
    assert result["settings"] == {"quick": True, "seed": 0, "size": 2}
    assert result["argv"][1:] == ["benchmarks/made_up.py", "--quick", "--out", out.name]
    # One print: the section as RESULTS.md would show it.
    printed = capsys.readouterr().out
    assert printed.count("## Made up") == 1 and "| size |\n| --- |\n| 2 |" in printed


def synthetic_result(**changes) -> dict:
    result = {
        "schema": 1,
        "benchmark": "never_seen",
        "title": "A benchmark no script writes",
        "description": "Made up for this test.",
        "command": "python benchmarks/never_seen.py --size 3",
        "argv": ["python", "benchmarks/never_seen.py", "--size", "3"],
        "machine": {"nproc": 7, "cpu_model": "Test CPU", "torch": "9.9",
                    "git_commit": "0123456789abcdef", "git_dirty": True,
                    "load_average_start": [0.5, 0.25, 0.125],
                    "load_average_end": [1.0, 0.5, 0.25],
                    "utc_start": "2030-01-01T00:00:00Z",
                    "utc_end": "2030-01-01T00:01:00Z"},
        "settings": {"size": 3},
        "complete": False,
        "tables": [
            {"title": "First table:", "columns": [["name", "name"], ["x", "x value"]],
             "rows": [{"name": "a", "x": 0.000012345}, {"name": "b"}],
             "notes": "A note under the first table."},
            {"title": "", "columns": [["n", "count"]], "rows": [{"n": 12345.0}],
             "notes": ""},
        ],
        "notes": "Closing notes.",
    }  # fmt: skip
    return {**result, **changes}


def test_render_results_renders_a_file_it_has_never_seen_without_the_scripts(
    tmp_path,
):
    path = tmp_path / "never_seen.json"
    path.write_text(json.dumps(synthetic_result()))
    out = tmp_path / "RESULTS.md"
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import render_results; "
        "render_results.main(sys.argv[1:]); "
        f"print(sorted(set(sys.modules) & set({sorted(SCRIPTS | {'torch'})!r})))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code, str(path), "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert completed.stdout.strip().splitlines()[-1] == "[]"  # nothing imported
    text = out.read_text()
    assert text.startswith("# Benchmarks")
    assert "## A benchmark no script writes" in text
    assert "Command: `python benchmarks/never_seen.py --size 3`" in text
    assert (
        "Machine: nproc 7; CPU Test CPU; torch 9.9; commit 0123456789ab with "
        "uncommitted changes; load average at start 0.50, 0.25, 0.12; load average "
        "at end 1.00, 0.50, 0.25; 2030-01-01T00:00:00Z to 2030-01-01T00:01:00Z"
    ) in text
    assert "Stopped before it finished" in text
    first_table = (
        "First table:\n\n| name | x value |\n| --- | --- |\n| a | 1.23e-05 |\n"
        "| b | – |\n\nA note under the first table."
    )
    assert first_table in text
    assert "| count |\n| --- |\n| 12345 |" in text
    assert "Closing notes." in text
    assert "No result file here was measured on a GPU" in text


def test_render_results_prints_a_repeated_closing_note_once(tmp_path):
    for name in ("a", "b"):
        result = synthetic_result(title=f"Section {name}", complete=True)
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    text = render_results.render([tmp_path], bare=True)
    assert text.index("## Section a") < text.index("## Section b")
    assert text.count("Closing notes.") == 1
    assert "# Benchmarks" not in text and "## GPU" not in text


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schema": 2}, "expected schema 1"),
        ({"title": None}, "title of type str"),
        ({"machine": {"nproc": 1}}, "machine.load_average_start"),
        ({"tables": [{"title": "", "columns": [["only key"]], "rows": [],
                      "notes": ""}]}, r"tables\[0\]: expected columns of \[key, header\]"),
        ({"tables": [{"title": "", "columns": [], "rows": [1], "notes": ""}]},
         "rows of objects"),
    ],
)  # fmt: skip
def test_check_result_names_the_field_that_breaks_the_format(changes, message):
    with pytest.raises(ValueError, match=message):
        render_results.check_result(synthetic_result(**changes), "never_seen.json")


def test_committed_results_render_to_the_committed_results_md():
    """RESULTS.md holds nothing but what benchmarks/results/ renders to."""
    paths = sorted((BENCHMARK_DIR / "results").glob("*.json"))
    assert {path.stem for path in paths} >= {
        "cpu_profile", "logprob_memory", "logprob_memory_trainable",
        "logprob_memory_trainable_b2", "time_to_accuracy", "trl_train_step",
    }  # fmt: skip
    rendered = render_results.render([BENCHMARK_DIR / "results"])
    assert rendered == (BENCHMARK_DIR / "RESULTS.md").read_text()


def test_recorded_and_rerun_command_lines_still_parse():
    """Each committed result's command, and each run_cpu.py run, parses today."""
    import async_grpo  # noqa: F401
    import kl_reference  # noqa: F401
    import length_bias  # noqa: F401
    import lora  # noqa: F401
    import mismatch_bias  # noqa: F401
    import mismatch_learning  # noqa: F401
    import notebook_times  # noqa: F401
    import opd  # noqa: F401
    import run_cpu
    import threads  # noqa: F401
    import time_to_accuracy  # also imports cpu_profile and trl_train_step
    import vllm_cpu  # noqa: F401

    modules = {name: sys.modules[name] for name in SCRIPTS - {"run_cpu", "harness"}}
    for path in (BENCHMARK_DIR / "results").glob("*.json"):
        argv, recorded = read(path)["argv"], read(path)["settings"]
        module = modules[Path(argv[1]).stem]
        parsed = vars(harness.arguments_of(module, argv[2:]))
        settings = {k: v for k, v in parsed.items() if k not in {"out", "worker"}}
        # A flag added after the run was recorded must default to what it ran.
        defaults = vars(harness.arguments_of(module, []))
        added = {k: v for k, v in settings.items() if k not in recorded}
        assert added == {k: defaults[k] for k in added}, path.name
        assert {k: settings[k] for k in recorded} == recorded, path.name
    for script, extra in run_cpu.BENCHMARKS.values():
        harness.arguments_of(modules[Path(script).stem], extra)
    assert time_to_accuracy.QUICK["config_overrides"]["eval_size"] == 4


def test_render_results_renders_the_quick_results(quick_dir):
    text = render_results.render([quick_dir], bare=True)
    assert "## Log-prob memory and time (CPU)" in text
    assert "benchmarks/logprob_memory.py --quick --in-process" in text
    assert "| frozen | 512 | 64 | chunk=16 |" in text
    assert "## Train-step and rollout throughput, tiny shape (CPU)" in text
    assert "new tokens/s" in text


@pytest.mark.slow
def test_gpu_script_cpu_smoke_runs_every_step(tmp_path):
    completed = subprocess.run(
        ["bash", str(BENCHMARK_DIR / "gpu.sh"), "--cpu-smoke"],
        cwd=REPO_ROOT,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    for name in ("logprob_memory_gpu.json", "gpu_throughput.json", "machine.txt"):
        assert (tmp_path / name).exists(), name
    results = (tmp_path / "GPU_RESULTS.md").read_text()
    assert "## Log-prob memory and time (CPU)" in results
    assert "## Train-step and rollout throughput" in results


@pytest.mark.slow
def test_trl_train_step_losses_and_gradients_agree(tmp_path):
    pytest.importorskip("trl")
    import trl_train_step

    out = tmp_path / "trl_train_step.json"
    result = trl_train_step.main(["--quick", "--out", str(out)])
    assert_records_its_run(read(out), "trl_train_step", ["--quick", "--out", str(out)])
    timing_table, agreement_table, sharing_table = result["tables"]
    (timing,) = timing_table["rows"]
    assert timing["ours_seconds"] > 0 and timing["trl_seconds"] > 0
    assert timing["trl_time_over_ours"] == pytest.approx(
        timing["trl_seconds"] / timing["ours_seconds"]
    )
    assert timing["ours_peak_mib"] > 0 and timing["trl_peak_mib"] > 0
    assert timing["shared_seconds"] > 0 and timing["shared_peak_mib"] > 0
    assert timing["trl_time_over_shared"] == pytest.approx(
        timing["trl_seconds"] / timing["shared_seconds"]
    )
    rows = {
        (r["trl_loss_type"], r["ours"].split(",")[0]): r
        for r in agreement_table["rows"]
    }
    assert set(rows) == {
        ("grpo", "grpo"),
        ("grpo", "none"),
        ("dr_grpo", "grpo"),
        ("dr_grpo", "none"),
    }
    for row in rows.values():
        assert row["max_abs_grad"] > 0
        assert row["max_abs_grad_diff"] < 1e-5 * max(1.0, row["max_abs_grad"])
    # Ratio 1 on both sides: the values coincide exactly where definitions do.
    assert rows[("grpo", "grpo")]["loss_abs_diff"] < 1e-6
    assert rows[("dr_grpo", "grpo")]["loss_abs_diff"] < 1e-6
    # The on-policy loss -A * log p has another value, the same gradient.
    assert rows[("dr_grpo", "none")]["loss_abs_diff"] > 1e-4
    # The sharing table: 4 rows as 2 x 2 (8-token prompts) and 1 x 4 (2 tokens).
    cases = {(r["group_size"], r["prompt_len"]): r for r in sharing_table["rows"]}
    assert set(cases) == {(2, 8), (4, 2)}
    assert cases[(2, 8)]["saved_positions"] == 2 * 7  # (B - U) * c
    assert cases[(4, 2)]["saved_positions"] == 3 * 1
    for row in cases.values():
        assert row["auto"] == "plain"  # far below AUTO_MIN_SAVED_POSITIONS
        assert row["shared_over_plain"] == pytest.approx(
            row["shared_seconds"] / row["plain_seconds"]
        )


@pytest.mark.slow
def test_time_to_accuracy_quick_runs_both_trainers(tmp_path):
    pytest.importorskip("trl")
    import time_to_accuracy

    out = tmp_path / "time_to_accuracy.json"
    result = time_to_accuracy.main(["--quick", "--out", str(out)])
    flags = ["--quick", "--out", str(out)]
    assert_records_its_run(read(out), "time_to_accuracy", flags)
    runs, summary = (table["rows"] for table in result["tables"])
    assert [run["framework"] for run in runs] == ["grpo_lab", "TRL"]
    for run in runs:
        # Quick: 2 steps, evaluated before the first and after each.
        assert [e["step"] for e in run["evaluations"]] == [0, 1, 2]
        assert run["seconds_per_step"] > 0
        assert run["common_steps"] == 2
    assert [row["framework"] for row in summary] == ["grpo_lab", "TRL"]
    assert result["config"]["eval_size"] == 4


def test_cpu_profile_quick_runs_the_real_command(tmp_path):
    import cpu_profile

    out = tmp_path / "cpu_profile.json"
    flags = ["--quick", "--seeds", "0", "--out", str(out)]
    cpu_profile.main(flags)
    result = read(out)
    assert_records_its_run(result, "cpu_profile", flags)
    (run,) = result["tables"][0]["rows"]
    assert run["seed"] == 0 and run["wall_seconds"] > 0
    assert run["grpo_steps"] == 2 and 1 <= run["sft_steps"] <= 2
    assert [e["step"] for e in run["evaluations"]] == [0, 1, 2]
    for key in ("sampled_start", "sampled_end", "greedy_start", "greedy_end"):
        assert 0.0 <= run[key] <= 1.0
    assert "- seed 0: 0: " in result["tables"][0]["notes"]


@pytest.mark.slow
def test_threads_runs_the_real_command_beside_a_busy_core():
    import cpu_profile
    import threads

    row = threads.timed_run(0, cpu_profile.QUICK["train_flags"], None, busy=True)
    assert (row["threads"], row["load"]) == ("chosen: 1", "one busy core")
    assert row["wall_seconds"] > row["grpo_step_seconds"] > 0
    # The busy loop is gone once the run returns.
    assert not [p for p in threads.multiprocessing.active_children() if p.is_alive()]
    rows = [dict(row), {**row, "slowdown": 1.5}]
    result = threads.report(rows, 2)
    render_results.check_result({**synthetic_result(), **result}, "threads.json")


def test_kl_reference_quick_measures_both_sides(tmp_path):
    import kl_reference

    out = tmp_path / "kl_reference.json"
    flags = ["--quick", "--out", str(out)]
    kl_reference.main(flags)
    result = read(out)
    assert_records_its_run(result, "kl_reference", flags)
    without, with_kl = result["tables"][0]["rows"]
    assert (without["kl_coef"], with_kl["kl_coef"]) == (0.0, 0.04)
    assert without["kl_mean"] is None and with_kl["kl_mean"] >= 0
    assert without["time_ratio"] == 1.0 and with_kl["step_seconds"] > 0


def test_mismatch_bias_quick_measures_every_perturbation(tmp_path):
    import mismatch_bias

    out = tmp_path / "mismatch_bias.json"
    flags = ["--quick", "--out", str(out)]
    mismatch_bias.main(flags)
    result = read(out)
    assert_records_its_run(result, "mismatch_bias", flags)
    gaps, biases = result["tables"]
    names = ["bf16", "top_p", "temperature", "noise", "stale"]  # stale last
    assert [row["perturbation"] for row in gaps["rows"]] == names
    assert [row["perturbation"] for row in biases["rows"]] == names
    by_name = {row["perturbation"]: row for row in gaps["rows"]}
    # bf16 rounding is a small gap; top_p's rho = 1 / mass(nucleus) <= 1.
    assert 0 < by_name["bf16"]["diff_mean"] < 0.05
    assert by_name["top_p"]["ratio_q0.99"] <= 1 + 1e-6
    for row in biases["rows"]:
        assert row["noise_floor"] > 0 and row["bias_none"] > 0


@pytest.mark.slow
def test_async_grpo_quick_runs_the_synchronous_loop_and_the_worker(tmp_path):
    import async_grpo

    out = tmp_path / "async_grpo.json"
    flags = ["--quick", "--out", str(out)]
    async_grpo.main(flags)
    result = read(out)
    assert_records_its_run(result, "async_grpo", flags)
    synchronous, paced = result["tables"][0]["rows"]
    assert synchronous["staleness"] == 0 and synchronous["flags"].startswith(
        "--rollout"
    )
    assert "--max-staleness 1 --async-admission pace" in paced["flags"]
    assert paced["dropped_share"] == 0  # pacing drops nothing
    assert 0 <= paced["staleness_mean"] <= 1
    cases = async_grpo.cases(harness.arguments_of(async_grpo, []))
    assert cases[0] == (0, "-", "none") and len(cases) == 13


def test_mismatch_learning_quick_trains_through_the_perturbed_sampler(tmp_path):
    import mismatch_learning

    out = tmp_path / "mismatch_learning.json"
    flags = ["--quick", "--out", str(out)]
    mismatch_learning.main(flags)
    result = read(out)
    assert_records_its_run(result, "mismatch_learning", flags)
    (row,) = result["tables"][0]["rows"]
    assert (row["perturbation"], row["correction"]) == ("stale", "token_truncate")
    assert "--mismatch-sync-every 4" in row["flags"]
    assert "--sampler-correction-cap 3" in row["flags"]
    assert row["sft_steps"] == 2 and len(row["reward_curve"]) == 2
    assert [e["step"] for e in row["evaluations"]] == [0, 1, 2]
    # The stale copy lags the warm-up's updates: a gap, and ratios around 1.
    assert row["sampler_log_prob_diff_mean"] > 0
    assert row["is_ratio_min"] <= row["is_ratio_mean"] <= row["is_ratio_max"]
    assert row["is_sequence_corrected_fraction"] == 0  # truncation drops nothing
    assert "stale 2 steps" in result["tables"][0]["notes"]
    cases = mismatch_learning.cases(harness.arguments_of(mismatch_learning, []))
    assert cases[0] == ("hf", "none") and len(cases) == 7


def test_length_bias_pairs_the_two_normalizations_of_each_seed():
    import length_bias

    def row(normalization, seed, length):
        metrics = dict.fromkeys(("length_mean", "length_last", "length_wrong"), length)
        return {"loss_normalization": normalization, "seed": seed, **metrics,
                "length_right": 10.0}  # fmt: skip

    rows = [
        row("sequence", 0, 12.0), row("constant", 0, 11.0),
        row("sequence", 1, 10.0), row("constant", 1, 12.0),
        row("sequence", 2, 14.0), row("constant", 2, 11.0),
        row("sequence", 3, 99.0),  # no constant run: left out
    ]  # fmt: skip
    summary = {entry["metric"]: entry for entry in length_bias.paired_differences(rows)}
    overall = summary["length, all steps"]
    assert overall["differences"] == [1.0, -2.0, 3.0]
    assert (overall["seeds"], overall["positive"]) == (3, 2)
    assert overall["mean"] == pytest.approx(2 / 3)
    # standard error = sample standard deviation / sqrt(n)
    assert overall["standard_error"] == pytest.approx((19 / 3) ** 0.5 / 3**0.5)
    assert summary["length, right"]["differences"] == [0.0, 0.0, 0.0]


def test_the_recorded_command_holds_no_absolute_path(tmp_path):
    script = str(BENCHMARK_DIR / "threads.py")
    outside = str(tmp_path / "figures.json")
    inside = str(BENCHMARK_DIR / "out" / "threads.json")
    command = harness.command_line(script, ["--out", outside, "--out", inside, "-3"])
    assert command[1:] == [
        "benchmarks/threads.py",
        "--out",
        "figures.json",
        "--out",
        "benchmarks/out/threads.json",
        "-3",
    ]
    assert not os.path.isabs(command[0]), command[0]  # the interpreter too


def test_opd_summary_compares_samples_with_grpos():
    """The OPD benchmark's summary: means over the seeds that reached the target,
    and each method's mean samples over GRPO's (hand-made runs)."""
    import opd

    def run(method, seed, steps):
        samples = None if steps is None else steps * 256
        return {"method": method, "seed": seed, "reached": steps is not None,
                "steps_to_target": steps, "samples_to_target": samples,
                "seconds_to_target": None if steps is None else steps / 10}  # fmt: skip

    runs = [
        run("GRPO", 0, 200), run("GRPO", 1, 160), run("OPD", 0, 40),
        run("OPD", 1, None), run("GRPO + OPD", 0, 60), run("GRPO + OPD", 1, 80),
    ]  # fmt: skip
    rows = {row["method"]: row for row in opd.summary_rows(runs)}
    assert rows["GRPO"]["mean_samples_to_target"] == 180 * 256
    assert rows["OPD"]["reached"] == 1
    assert rows["OPD"]["samples_over_grpo"] == pytest.approx(40 / 180)
    assert rows["GRPO + OPD"]["samples_over_grpo"] == pytest.approx(70 / 180)


@pytest.mark.slow
def test_notebook_times_quick_executes_notebook_00_on_the_cpu_profile(tmp_path):
    import notebook_times

    out = tmp_path / "notebook_times.json"
    flags = ["--quick", "--out", str(out)]
    notebook_times.main(flags)
    result = read(out)
    assert_records_its_run(result, "notebook_times", flags)
    (row,) = result["tables"][0]["rows"]
    assert row["notebook"] == "00_welcome_and_setup" and row["cells"] > 5
    assert row["wall_seconds"] > row["slowest_cell_seconds"] > 0
    assert row["slowest_cell"].startswith("#")
    assert row["under_limit"] is (row["wall_seconds"] < 180)
    with pytest.raises(SystemExit, match="no notebook numbered"):
        notebook_times.chosen(["99"])
    assert [path.name[:2] for path in notebook_times.chosen(["15", "16"])] == [
        "15", "16",
    ]  # fmt: skip


def test_async_grpo_summary_means_each_case_over_its_seeds():
    """Means over every seed, and to the target over the seeds that reached it."""
    import async_grpo

    def row(seed, bound, samples, end):
        return {"seed": seed, "staleness": bound, "admission": "pace",
                "correction": "none", "train_seconds": 10.0 + seed,
                "seconds_to_target": None if samples is None else samples / 1000,
                "samples_to_target": samples, "sampled_end": end,
                "dropped_share": 0.0, "staleness_mean": bound * 0.9}  # fmt: skip

    rows = [row(0, 1, 4000, 0.9), row(1, 1, None, 0.7), row(0, 2, 6000, 0.95)]
    first, second = async_grpo.summary_rows(rows)
    assert (first["staleness"], first["reached"]) == (1, "1 of 2")
    assert first["train_seconds"] == 10.5 and first["sampled_end"] == pytest.approx(0.8)
    assert first["samples_to_target"] == 4000 and first["seconds_to_target"] == 4
    assert (second["staleness"], second["reached"]) == (2, "1 of 1")
