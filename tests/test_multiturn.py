"""Multi-turn rollouts: who wrote each token, the model-only mask, its gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.rollouts.base import Rollouts, SamplingSettings
from grpo_lab.rollouts.hf import HFRolloutBackend
from grpo_lab.rollouts.multiturn import (
    MODEL,
    SEPARATOR,
    TOOL,
    MultiTurnRolloutBackend,
    MultiTurnRollouts,
    Segment,
    pad_prompt_and_segment_ids,
    replayed_rollouts,
    tool_metrics,
    trained_tool_token_metrics,
)
from grpo_lab.rollouts.tools import CalculatorTool
from grpo_lab.tasks import get_task
from grpo_lab.train_step import UpdateSettings, microbatch_loss
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import (
    rollout_token_batch,
    sampler_log_prob_batch,
    with_task_tool,
)


def _segment(role: str, ids: list[int], text: str = "") -> Segment:
    return Segment(role, tuple(ids), text)


# --- the mask ---------------------------------------------------------------------


def test_segment_mask_follows_the_labels_at_each_turn_boundary():
    # ids    = 5 6 | 7 8 | 9 | 10 | 11 | 12      (prompt | model | sep | tool | sep | model)
    # labels =   6   7 8   9   10   11   12      (ids shifted by one)
    # mask   =   0   1 1   0    0    0    1      (1 where the label was sampled)
    segments = [
        [
            _segment(MODEL, [7, 8]),
            _segment(SEPARATOR, [9]),
            _segment(TOOL, [10]),
            _segment(SEPARATOR, [11]),
            _segment(MODEL, [12]),
        ]
    ]
    batch = pad_prompt_and_segment_ids([[5, 6]], segments, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[6, 7, 8, 9, 10, 11, 12]]
    assert batch["response_mask"].tolist() == [[0, 1, 1, 0, 0, 0, 1]]


def test_segment_mask_pads_rows_of_different_lengths():
    # row 0: ids 1 | 2 | 3 -> labels 2 3, mask 1 0, then a pad column
    # row 1: ids 1 | 4 5 6  -> labels 4 5 6, mask 1 1 1
    segments = [
        [_segment(MODEL, [2]), _segment(TOOL, [3])],
        [_segment(MODEL, [4, 5, 6])],
    ]
    batch = pad_prompt_and_segment_ids([[1], [1]], segments, pad_token_id=0)
    assert batch["labels"].tolist() == [[2, 3, 0], [4, 5, 6]]
    assert batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]


def test_model_segments_only_give_the_single_turn_tensors_bit_for_bit():
    prompt_ids = [[3, 4, 5], [6]]
    response_ids = [[7, 8], [9, 10, 11, 12]]
    segments = [[_segment(MODEL, ids)] for ids in response_ids]
    expected = pad_prompt_and_response_ids(prompt_ids, response_ids, 0)
    got = pad_prompt_and_segment_ids(prompt_ids, segments, 0)
    for key in expected:
        assert got[key].dtype == expected[key].dtype
        assert torch.equal(got[key], expected[key])


@pytest.mark.parametrize(
    "segments",
    [
        [[Segment("user", (1,), "")]],
        [[(MODEL, (1,))]],
        [],
    ],
)
def test_bad_segments_are_refused(segments):
    with pytest.raises(ValueError, match="segments"):
        pad_prompt_and_segment_ids([[1]], segments, 0)


# --- the gradient through the package's loss ----------------------------------


LOSS_SETTINGS = [
    {},
    {"loss_normalization": "token"},
    {"loss_normalization": "constant", "normalization_constant": 8},
    {"importance_reweighting_method": "grpo", "cliprange": 0.2},
    {"importance_reweighting_method": "gspo", "cliprange": 3e-4},
    {"importance_reweighting_method": "cispo", "cliprange": 0.2},
    {"kl_coef": 0.1},
    {"entropy_coef": 0.01},
]


def _multi_turn_batch() -> dict[str, torch.Tensor]:
    segments = [
        [
            _segment(MODEL, [7, 8]),
            _segment(SEPARATOR, [9]),
            _segment(TOOL, [10, 11]),
            _segment(SEPARATOR, [12]),
            _segment(MODEL, [13, 1]),
        ],
        [_segment(MODEL, [14, 15, 16, 1])],
    ]
    return pad_prompt_and_segment_ids([[5, 6], [5, 6]], segments, 0)


@pytest.mark.parametrize("options", LOSS_SETTINGS)
def test_tool_and_separator_tokens_get_exactly_zero_gradient(tiny_qwen2, options):
    torch.manual_seed(0)
    model = tiny_qwen2.double()
    batch = _multi_turn_batch()
    logits = model(input_ids=batch["input_ids"]).logits  # (B, T, V)
    logits.retain_grad()
    log_probs = torch.log_softmax(logits, dim=-1).gather(2, batch["labels"][..., None])[
        ..., 0
    ]  # (B, T)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # (B, T)
    microbatch = {
        "response_mask": batch["response_mask"],
        "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
        "old_log_probs": (log_probs.detach() + 0.05),
        "reference_log_probs": (log_probs.detach() - 0.1),
    }
    settings = UpdateSettings(**options)
    loss, _ = microbatch_loss(log_probs, entropy, microbatch, settings)
    loss.backward()
    per_position = logits.grad.abs().sum(dim=-1)  # (B, T)
    not_trained = batch["response_mask"] == 0
    assert torch.all(per_position[not_trained] == 0)
    # row 0: labels 6 7 8 9 10 11 12 13 1 -> model tokens at columns 1, 2, 7, 8
    assert torch.all(per_position[0, [1, 2, 7, 8]] > 0)


def test_training_on_tool_output_gives_those_tokens_a_gradient(tiny_qwen2):
    # The bug the mask prevents: every response token in the mask.
    model = tiny_qwen2.double()
    batch = _multi_turn_batch()
    wrong_mask = pad_prompt_and_response_ids(
        [[5, 6], [5, 6]],
        [[7, 8, 9, 10, 11, 12, 13, 1], [14, 15, 16, 1]],
        0,
    )["response_mask"]
    logits = model(input_ids=batch["input_ids"]).logits  # (B, T, V)
    logits.retain_grad()
    log_probs = torch.log_softmax(logits, dim=-1).gather(2, batch["labels"][..., None])[
        ..., 0
    ]  # (B, T)
    microbatch = {
        "response_mask": wrong_mask,
        "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
    }
    loss, _ = microbatch_loss(log_probs, None, microbatch, UpdateSettings())
    loss.backward()
    tool_columns = [3, 4, 5, 6]  # labels 9 10 11 12: separator, tool, separator
    assert torch.all(logits.grad[0, tool_columns].abs().sum(-1) > 0)


# --- episodes with a scripted policy ---------------------------------------------


class ScriptedBackend:
    """An hf-like backend whose turns are fixed texts (character tokenizer).

    ``turns[j]`` is the text every response writes in turn j + 1; its
    log-probs are -(index of the token in the whole episode's model tokens).
    """

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.calls: list[SamplingSettings] = []
        self.contexts: list[list[list[int]]] = []

    def _turn(self, sampling: SamplingSettings) -> tuple[list[int], str]:
        text = self.turns[len(self.calls)]
        self.calls.append(sampling)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[: sampling.max_new_tokens], text[: sampling.max_new_tokens]

    def generate(self, prompts, group_size, sampling):
        ids, text = self._turn(sampling)
        prompt_ids = [
            self.tokenizer.encode(p, add_special_tokens=False)
            for p in prompts
            for _ in range(group_size)
        ]
        rows = len(prompt_ids)
        return Rollouts(
            prompts=[p for p in prompts for _ in range(group_size)],
            responses=[text] * rows,
            prompt_token_ids=prompt_ids,
            response_token_ids=[list(ids) for _ in range(rows)],
            sampler_log_probs=[[-0.5] * len(ids) for _ in range(rows)],
        )

    def continue_ids(self, context_ids, sampling):
        self.contexts.append(context_ids)
        ids, text = self._turn(sampling)
        rows = len(context_ids)
        return (
            [list(ids) for _ in range(rows)],
            [[-1.5] * len(ids) for _ in range(rows)],
            [text] * rows,
        )

    def sync(self, policy):
        pass


def _scripted(char_tokenizer, turns, max_turns=3):
    backend = ScriptedBackend(char_tokenizer, turns)
    return backend, MultiTurnRolloutBackend(
        backend, CalculatorTool(), max_turns=max_turns
    )


def test_a_tool_call_is_answered_and_sampling_resumes(char_tokenizer):
    backend, multi = _scripted(char_tokenizer, ["<calc>12*34</calc>", "408"])
    sampling = SamplingSettings(max_new_tokens=60, seed=7)
    rollouts = multi.generate(["12*34="], 2, sampling)
    assert rollouts.responses == ["<calc>12*34</calc><out>408</out>408"] * 2
    roles = [s.role for s in rollouts.segments[0]]
    assert roles == [MODEL, SEPARATOR, TOOL, SEPARATOR, MODEL]
    assert rollouts.end_reasons == ["answered", "answered"]
    assert rollouts.turns == [2, 2] and rollouts.tool_calls == [1, 1]
    # one sampler log-prob per model token: 18 in turn 1, 3 in turn 2
    assert rollouts.sampler_log_probs[0] == [-0.5] * 18 + [-1.5] * 3
    # turn 2 resumes from prompt + everything so far, ids as written
    context = backend.contexts[0][0]
    assert char_tokenizer.decode(context) == "12*34=<calc>12*34</calc><out>408</out>"
    # the first turn stops at the call; later turns get their own seed and room
    assert "</calc>" in backend.calls[0].stop_strings
    assert backend.calls[0].seed == 7 and backend.calls[1].seed != 7
    assert backend.calls[1].max_new_tokens == 60 - len(context) + len("12*34=")


def test_the_loop_batch_masks_tool_tokens_and_aligns_sampler_log_probs(
    char_tokenizer,
):
    _, multi = _scripted(char_tokenizer, ["<calc>1+2</calc>", "3"])
    rollouts = multi.generate(["1+2="], 1, SamplingSettings(max_new_tokens=40))
    batch = rollout_token_batch(rollouts, char_tokenizer)
    mask = batch["response_mask"][0]
    labels = char_tokenizer.decode(batch["labels"][0][mask.bool()])
    assert labels == "<calc>1+2</calc>3"
    assert int(mask.sum()) == len(rollouts.sampler_log_probs[0])
    padded = sampler_log_prob_batch(rollouts, batch["response_mask"])
    assert padded[0][mask.bool()].tolist() == [-0.5] * 16 + [-1.5]
    assert torch.all(padded[0][~mask.bool()] == 0)


def test_a_call_in_the_last_allowed_turn_is_not_run(char_tokenizer):
    _, multi = _scripted(
        char_tokenizer, ["<calc>1+2</calc>", "<calc>3+4</calc>"], max_turns=2
    )
    rollouts = multi.generate(["x="], 1, SamplingSettings(max_new_tokens=60))
    assert rollouts.responses == ["<calc>1+2</calc><out>3</out><calc>3+4</calc>"]
    assert rollouts.end_reasons == ["turn_limit"]
    assert rollouts.tool_calls == [1]
    metrics = rollouts.sampling_metrics
    assert metrics["tools/turn_limit_fraction"] == 1.0
    assert metrics["tools/turns_mean"] == 2.0


def test_the_token_budget_bounds_the_whole_episode(char_tokenizer):
    # 16 call tokens + 12 reply tokens = 28 of a 30-token budget: 2 left to answer.
    _, multi = _scripted(char_tokenizer, ["<calc>1+2</calc>", "3333"])
    rollouts = multi.generate(["x="], 1, SamplingSettings(max_new_tokens=30))
    assert rollouts.responses == ["<calc>1+2</calc><out>3</out>33"]
    assert len(rollouts.response_token_ids[0]) == 30
    assert rollouts.end_reasons == ["budget"]


def test_no_reply_is_appended_when_it_would_leave_no_room(char_tokenizer):
    _, multi = _scripted(char_tokenizer, ["<calc>1+2</calc>", "3"])
    rollouts = multi.generate(["x="], 1, SamplingSettings(max_new_tokens=28))
    assert rollouts.responses == ["<calc>1+2</calc>"]
    assert rollouts.end_reasons == ["budget"] and rollouts.tool_calls == [0]


def test_tool_errors_and_metrics_are_counted(char_tokenizer):
    _, multi = _scripted(char_tokenizer, ["<calc>1/0</calc>", "<calc>2*3</calc>", "6"])
    rollouts = multi.generate(["x="], 2, SamplingSettings(max_new_tokens=80))
    assert rollouts.responses[0] == (
        "<calc>1/0</calc><out>error</out><calc>2*3</calc><out>6</out>6"
    )
    assert rollouts.tool_errors == [1, 1] and rollouts.tool_calls == [2, 2]
    model_tokens = 16 + 16 + 1
    expected = {
        "tools/turns_mean": 3.0,
        "tools/calls_mean": 2.0,
        "tools/errors_mean": 1.0,
        "tools/model_token_fraction": model_tokens / (model_tokens + 16 + 12),
        "tools/turn_limit_fraction": 0.0,
        "tools/budget_fraction": 0.0,
    }
    assert tool_metrics(rollouts) == pytest.approx(expected)
    assert rollouts.sampling_metrics == tool_metrics(rollouts)


def test_multi_turn_backend_refuses_bad_settings(char_tokenizer):
    with pytest.raises(ValueError, match="max_turns"):
        _scripted(char_tokenizer, [], max_turns=0)
    with pytest.raises(ValueError, match="backend must resume from token ids"):
        MultiTurnRolloutBackend(object(), CalculatorTool())


# --- the real hf backend ----------------------------------------------------------


def test_single_turn_rollouts_are_bit_identical_to_the_hf_backend(
    tiny_qwen2, char_tokenizer
):
    # A random model never closes a call: every episode is one turn.
    hf = HFRolloutBackend(tiny_qwen2, char_tokenizer)
    multi = MultiTurnRolloutBackend(hf, CalculatorTool(), max_turns=2)
    sampling = SamplingSettings(max_new_tokens=12, seed=3)
    prompts = ["12*34=", "56*78="]
    single = hf.generate(prompts, 3, sampling)
    episodes = multi.generate(prompts, 3, sampling)
    assert isinstance(episodes, MultiTurnRollouts)
    assert episodes.turns == [1] * 6
    for name in (
        "prompts",
        "responses",
        "prompt_token_ids",
        "response_token_ids",
        "sampler_log_probs",
    ):
        assert getattr(episodes, name) == getattr(single, name), name
    single_batch = rollout_token_batch(single, char_tokenizer)
    multi_batch = rollout_token_batch(episodes, char_tokenizer)
    for key, value in single_batch.items():
        assert multi_batch[key].dtype == value.dtype
        assert torch.equal(multi_batch[key], value), key


def test_continue_ids_samples_what_generate_samples(tiny_qwen2, char_tokenizer):
    hf = HFRolloutBackend(tiny_qwen2, char_tokenizer)
    sampling = SamplingSettings(max_new_tokens=8, seed=5, stop_strings=("7",))
    rollouts = hf.generate(["12*34=", "5+6="], 1, sampling)
    ids, log_probs, texts = hf.continue_ids(rollouts.prompt_token_ids, sampling)
    assert ids == rollouts.response_token_ids
    assert log_probs == rollouts.sampler_log_probs
    assert texts == rollouts.responses
    with pytest.raises(ValueError, match="context_ids"):
        hf.continue_ids([], sampling)


def test_a_tool_using_task_gets_the_multi_turn_backend(tiny_qwen2, char_tokenizer):
    hf = HFRolloutBackend(tiny_qwen2, char_tokenizer)
    config = TrainConfig.for_profile("smoke", task="calculator")
    wrapped = with_task_tool(config, hf)
    assert isinstance(wrapped, MultiTurnRolloutBackend)
    assert wrapped.max_turns == get_task("calculator").max_turns
    single = dataclasses.replace(config, task="reverse", task_options={})
    assert with_task_tool(single, hf) is hf


# --- settings -----------------------------------------------------------------------


def test_config_checks_a_tool_task_at_construction():
    with pytest.raises(ValueError, match="max_turns"):
        TrainConfig.for_profile(
            "smoke", task="calculator", task_options={"max_turns": 0}
        )
    with pytest.raises(ValueError, match="backend must be 'hf' or 'vllm'"):
        TrainConfig.for_profile("smoke", task="calculator", backend="mismatch")
    with pytest.raises(ValueError, match="dynamic_sampling"):
        TrainConfig.for_profile("smoke", task="calculator", dynamic_sampling=True)


def test_a_task_named_without_options_does_not_inherit_the_profiles():
    config = TrainConfig.for_profile("cpu", task="calculator")
    assert config.task_options == {}
    assert TrainConfig.for_profile("cpu").task_options == {"n_digits": 5}
    assert TrainConfig.for_profile("cpu", task="addition").task_options == {}


def test_the_cpu_profile_sizes_a_calculator_run_and_overrides_still_win():
    from grpo_lab.training.config import CPU_TASK_CHANGES

    config = TrainConfig.for_profile("cpu", task="calculator")
    for name, value in CPU_TASK_CHANGES["calculator"].items():
        assert getattr(config, name) == value, name
    assert TrainConfig.for_profile("cpu", task="calculator", steps=7).steps == 7
    assert TrainConfig.for_profile("smoke", task="calculator").steps == 2
    assert TrainConfig.for_profile("cpu", task="reverse").steps == 400


# --- the exercise check of notebook 14 ----------------------------------------------


def _flags_mask(prompt_ids, segments, roles, shift="labels"):
    rows = [
        [0] * len(p) + [int(s.role in roles) for s in row for _ in s.token_ids]
        for p, row in zip(prompt_ids, segments)
    ]
    width = max(len(r) for r in rows)
    full = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # (B, T)
    return full[:, 1:] if shift == "labels" else full[:, :-1]


@pytest.mark.parametrize(
    ("slip", "roles", "shift", "named"),
    [
        ("tool tokens kept", (MODEL, TOOL), "labels", "tool tokens are kept"),
        ("separators kept", (MODEL, SEPARATOR), "labels", "separator tokens are kept"),
        ("off by one", (MODEL,), "input_ids", "off by one at each turn boundary"),
        ("everything", (MODEL, TOOL, SEPARATOR), "labels", "single-turn mask"),
    ],
)
def test_the_mask_check_rejects_each_slip_and_names_it(slip, roles, shift, named):
    from grpo_lab.teaching.checks import ExerciseFailed
    from grpo_lab.teaching.checks.turns import check_multi_turn_mask

    def student(prompt_ids, segments):
        return _flags_mask(prompt_ids, segments, roles, shift)

    with pytest.raises(ExerciseFailed, match=named):
        check_multi_turn_mask(student)


def test_the_mask_check_passes_the_right_mask_and_refuses_bad_shapes(capsys):
    from grpo_lab.teaching.checks import ExerciseFailed
    from grpo_lab.teaching.checks.turns import check_multi_turn_mask

    assert check_multi_turn_mask(lambda p, s: _flags_mask(p, s, (MODEL,))) is True
    assert "correct" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="expected shape"):
        check_multi_turn_mask(lambda p, s: _flags_mask(p, s, (MODEL,))[:, :-1])
    with pytest.raises(ExerciseFailed, match="expected a tensor"):
        check_multi_turn_mask(lambda p, s: [[0]])


def test_author_table_colours_each_author():
    from grpo_lab.teaching.plots import AUTHOR_COLOURS, author_table

    table = author_table(["<", "5"], ["model", "tool"], [1, 0])
    assert AUTHOR_COLOURS["model"] in table and AUTHOR_COLOURS["tool"] in table
    assert "&lt;" in table
    with pytest.raises(ValueError, match="one entry per position"):
        author_table(["a"], ["model", "tool"], [1])
    with pytest.raises(ValueError, match="authors must be among"):
        author_table(["a"], ["user"], [1])


def test_an_episode_table_colours_each_label_by_the_author_of_its_token():
    import re

    from grpo_lab.teaching.plots import AUTHOR_COLOURS, episode_author_table

    segments = [Segment(MODEL, (7, 8), ""), Segment(TOOL, (10,), "")]
    table = episode_author_table(["6", "7", "8", "10"], 2, segments, [0, 1, 1, 0])
    label_row = table.split("</tr>")[0]
    colours = re.findall(r"background:(#[0-9a-f]{6})", label_row)
    # The labels hold tokens 1..4: the prompt's second, the model's two, the tool's.
    authors = ["prompt", "model", "model", "tool"]
    assert colours == [AUTHOR_COLOURS[a] for a in authors]


def test_a_turn_is_cut_at_max_turn_tokens(char_tokenizer):
    backend = ScriptedBackend(char_tokenizer, ["1234567890"])
    multi = MultiTurnRolloutBackend(backend, CalculatorTool(), max_turn_tokens=4)
    rollouts = multi.generate(["x="], 1, SamplingSettings(max_new_tokens=30))
    assert backend.calls[0].max_new_tokens == 4
    assert rollouts.responses == ["1234"] and rollouts.end_reasons == ["budget"]
    with pytest.raises(ValueError, match="max_turn_tokens"):
        MultiTurnRolloutBackend(backend, CalculatorTool(), max_turn_tokens=0)


# --- fixed episodes and the trained-tool-token metric -------------------------------


def test_replayed_rollouts_run_the_tool_between_the_given_turns(char_tokenizer):
    encode = lambda text: char_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = char_tokenizer.eos_token_id
    rollouts = replayed_rollouts(
        char_tokenizer,
        CalculatorTool(),
        ["12*34=", "12*34="],
        [
            [encode("<calc>12*34</calc>"), [*encode("408"), eos]],
            [encode("<calc>1/0</calc>")],  # a call in the last turn is not run
        ],
        log_prob=-0.25,
    )
    assert rollouts.responses == [
        "<calc>12*34</calc><out>408</out>408",
        "<calc>1/0</calc>",
    ]
    assert [s.role for s in rollouts.segments[0]] == [
        MODEL,
        SEPARATOR,
        TOOL,
        SEPARATOR,
        MODEL,
    ]
    assert rollouts.end_reasons == ["answered", "budget"]
    assert rollouts.tool_calls == [1, 0] and rollouts.tool_errors == [0, 0]
    assert rollouts.sampler_log_probs[0] == [-0.25] * (18 + 4)
    with pytest.raises(ValueError, match="one list of turns per prompt"):
        replayed_rollouts(char_tokenizer, CalculatorTool(), ["1="], [])


def test_trained_tool_tokens_are_0_with_the_right_mask_and_1_with_the_bug(
    char_tokenizer,
):
    encode = lambda text: char_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    turns = [[encode("<calc>1+2</calc>"), [*encode("3"), 1]], [[*encode("3"), 1]]]
    rollouts = replayed_rollouts(char_tokenizer, CalculatorTool(), ["1+2="] * 2, turns)
    right = rollout_token_batch(rollouts, char_tokenizer)["response_mask"]
    wrong = pad_prompt_and_response_ids(
        rollouts.prompt_token_ids, rollouts.response_token_ids, 0
    )["response_mask"]
    key = "tools/trained_tool_token_fraction"
    assert trained_tool_token_metrics(rollouts, right) == {key: 0.0}
    assert trained_tool_token_metrics(rollouts, wrong) == {key: 1.0}
    # labels 20..22 are the tool's tokens 21..23 ("out" of "<out>"): 3 of the
    # 12 tool and separator tokens ("<out>3</out>")
    half = right.clone()
    half[0, 20:23] = 1
    assert trained_tool_token_metrics(rollouts, half)[key] == pytest.approx(3 / 12)
    single = Rollouts(["1"], ["2"], [[5]], [[6]], [[-1.0]])
    assert trained_tool_token_metrics(single, right[:1]) == {}


def test_the_warm_up_trains_a_demonstration_s_model_tokens_only(char_tokenizer):
    from grpo_lab.rollouts.multiturn import demonstration_segments
    from grpo_lab.training.sft import demonstration_batch

    task = get_task("calculator")
    example = task.example(37, 58)
    segments = demonstration_segments(char_tokenizer, task.tool, example.demonstration)
    assert [(s.role, s.text) for s in segments] == [
        (MODEL, "<calc>37*58</calc>"),
        (SEPARATOR, "<out>"),
        (TOOL, "2146"),
        (SEPARATOR, "</out>"),
        (MODEL, "2146"),
        (MODEL, ""),  # EOS
    ]
    masked = demonstration_batch([example], char_tokenizer, task.tool)
    plain = demonstration_batch([example], char_tokenizer)
    assert torch.equal(masked["labels"], plain["labels"])
    trained = masked["labels"][0][masked["response_mask"][0].bool()]
    assert char_tokenizer.decode(trained) == "<calc>37*58</calc>2146<eos>"
    with pytest.raises(ValueError, match="close each"):
        demonstration_segments(char_tokenizer, task.tool, "<out>12")
