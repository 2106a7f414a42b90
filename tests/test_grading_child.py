"""The student's function in a child process, called from the grader's side."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_lab.instructor import grading_child
from grpo_lab.instructor.grading_child import (
    Child,
    ChildLost,
    RemoteFunction,
    SolutionRaised,
    serve_function,
)
from grpo_lab.instructor.grading_kernel import one_line

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork"), reason="the grader's child is a forked process"
)


def _serve(source: str) -> dict:
    """In the child: serve the function that ``source`` (an expression) makes."""
    namespace = {"torch": torch, "os": os}
    exec(f"fn = {source}", namespace)
    serve_function(namespace["fn"])
    return {}


def _cleanup(child: Child) -> None:
    child.stop()


@pytest.fixture
def child():
    made = Child({"serve": _serve})
    yield made
    _cleanup(made)


def _remote(child: Child, source: str) -> tuple[RemoteFunction, list]:
    child.ask("serve", source)
    raised: list = []
    return RemoteFunction(child, "fn", raised), raised


PAIR = (
    "lambda x, w: {'y': (x @ w).tanh(), 'n': [x.sum() ** 2, 3], 'i': x.argmax(dim=-1)}"
)


def test_values_and_gradients_match_a_local_call_in_float64(child):
    fn, _ = _remote(child, PAIR)
    local = eval(PAIR)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    w = torch.randn(3, 2, generator=generator, dtype=torch.float64)
    results = []
    for call in (fn, local):
        inputs = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        out = call(*inputs)
        loss = (out["y"] * torch.arange(8.0).view(4, 2)).sum() + out["n"][0]
        loss.backward()
        results.append((out, [t.grad for t in inputs]))
    (remote_out, remote_grads), (local_out, local_grads) = results
    assert remote_out["n"][1] == 3 and remote_out["y"].dtype == torch.float64
    torch.testing.assert_close(remote_out["y"], local_out["y"], rtol=0, atol=1e-12)
    assert torch.equal(remote_out["i"], local_out["i"])
    assert not remote_out["i"].requires_grad
    for got, want in zip(remote_grads, local_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b: fn(a, b)["y"],
        (x.clone().requires_grad_(True), w.clone().requires_grad_(True)),
    )


def test_no_grad_is_kept_and_a_result_without_tensors_comes_back(child):
    fn, _ = _remote(child, "lambda x: (torch.is_grad_enabled(), float(x.sum()))")
    x = torch.ones(3, requires_grad=True)
    assert fn(x) == (True, 3.0)
    with torch.no_grad():
        assert fn(x) == (False, 3.0)


class Policy:
    """A plain object whose bound methods a check hands over."""

    def __init__(self) -> None:
        self.weights = torch.zeros(2, requires_grad=True)
        self.optimizer = torch.optim.SGD([self.weights], lr=1.0)
        self.losses: list[float] = []
        self.calls = 0

    def step(self, scale: float) -> None:
        self.optimizer.zero_grad()
        loss = (self.weights - scale).pow(2).sum()
        loss.backward()
        self.losses.append(loss.item())
        self.calls += 1
        self.optimizer.step()


def test_the_arguments_state_after_the_call_is_applied_in_place(child):
    fn, _ = _remote(
        child,
        "lambda step, t, model, opt: ("
        "step(1.0), step(2.0), t.mul_(2),"
        " model(torch.ones(1, 2)).sum().backward(), opt.step(), None)[-1]",
    )
    policy, tensor = Policy(), torch.arange(3.0)
    weights = policy.weights
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    assert fn(policy.step, tensor, model, optimizer) is None
    assert policy.weights is weights  # the same tensor, changed in place
    expected = Policy()
    expected.step(1.0)
    expected.step(2.0)
    assert policy.losses == expected.losses and policy.calls == 2
    assert torch.equal(policy.weights, expected.weights)
    assert torch.equal(tensor, torch.tensor([0.0, 2.0, 4.0]))
    for parameter, old in zip(model.parameters(), before):
        assert parameter.grad is not None
        assert torch.allclose(parameter, old - 0.5 * parameter.grad)
    assert len(optimizer.state_dict()["state"]) == 2  # momentum buffers came back


def test_a_parameters_hook_sees_the_gradient_after_the_last_backward(child):
    fn, _ = _remote(
        child,
        "lambda m: (m.weight.sum().backward(), (2 * m.weight.sum()).backward(),"
        " m.weight.grad.mul_(10), None)[-1]",
    )
    model = torch.nn.Linear(2, 1, bias=False)
    seen = []
    model.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(p.grad.clone())
    )
    fn(model)
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((1, 2), 3.0))
    assert torch.equal(model.weight.grad, torch.full((1, 2), 30.0))


def test_the_students_exception_is_rebuilt_and_counted_as_its_own(child):
    fn, raised = _remote(child, "lambda x: [][x]")
    with pytest.raises(IndexError, match="list index out of range"):
        fn(1)
    class_source = "type('Odd', (Exception,), {})"
    fn, raised = _remote(
        child, f"lambda x: (_ for _ in ()).throw({class_source}('no'))"
    )
    with pytest.raises(SolutionRaised) as caught:
        fn(1)
    assert caught.value.type_name == "Odd" and raised == [caught.value]
    assert one_line(caught.value) == "Odd: no"  # as the verdict names it


def test_the_child_keeps_only_its_pipes_and_cannot_read_the_parent(child):
    fn, _ = _remote(
        child,
        "lambda: [os.path.realpath(f'/proc/self/fd/{n}')"
        " for n in os.listdir('/proc/self/fd') if int(n) > 2]",
    )
    held = fn()
    pipes = [target for target in held if "pipe:" in target]
    assert len(pipes) == 2 and len(held) <= 3, held  # and the listing's own
    if not sys.platform.startswith("linux") or os.geteuid() == 0:
        return  # root may read any process
    fn, _ = _remote(child, "lambda: open(f'/proc/{os.getppid()}/mem', 'rb').read(1)")
    with pytest.raises(PermissionError):
        fn()


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > evil-marker",))


def test_a_malicious_pickle_from_the_child_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ChildLost, match="does not read"):
        grading_child.decode(pickle.dumps({"result": Evil()}))
    child = Child({"evil": _send_evil})
    try:
        with pytest.raises(ChildLost, match="does not read"):
            child.ask("evil", None)
    finally:
        child.stop()
    assert not (tmp_path / "evil-marker").exists()


def _send_evil(request: object) -> dict:
    """In the child: a forged reply on every descriptor it holds."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            grading_child.send(int(name), pickle.dumps({"result": Evil()}))
    return {}


def test_a_dead_child_is_lost_never_a_result(child):
    fn, _ = _remote(child, "lambda: os._exit(3)")
    with pytest.raises(ChildLost):
        fn()
    with pytest.raises(ChildLost):
        fn()  # and stays lost


@pytest.mark.slow
def test_a_fresh_process_gets_a_copy_of_the_students_function(child):
    """A check may call the student's function in a fresh Python process: the
    stand-in pickles as a dill copy made in the child, which the parent never
    loads."""
    pytest.importorskip("dill")
    fn, _ = _remote(child, "lambda x: x * 7")
    finished = subprocess.run(
        [sys.executable, "-c", FRESH],
        input=pickle.dumps(fn),
        capture_output=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        check=True,
        timeout=120,
    )
    assert finished.stdout.decode().strip() == "21"


FRESH = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())(3))"


def test_a_state_that_does_not_fit_its_argument_changes_nothing():
    """What a child reports is applied only where it fits: the same kind, the
    same shape, a public attribute the object already has."""
    policy = Policy()
    before = dict(vars(policy))
    weights = policy.weights.detach().clone()
    hostile = {
        "kind": "object",
        "attributes": {
            "weights": {"kind": "tensor", "data": torch.ones(5), "grad": None},
            "calls": {"kind": "module", "parameters": [], "buffers": []},
            "__class__": {"kind": "value", "value": 1},
            "_secret": {"kind": "value", "value": 1},
            "planted": {"kind": "value", "value": 1},
        },
    }
    grading_child.apply_state(policy.step, hostile)
    grading_child.apply_state(policy, ["not", "a", "state"])
    grading_child.apply_state(policy.weights, {"kind": "module"})
    assert type(policy) is Policy and vars(policy) == before
    assert torch.equal(policy.weights, weights) and policy.calls == 0


def test_a_message_past_the_limit_is_refused_before_it_is_read():
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, (grading_child.MESSAGE_LIMIT + 1).to_bytes(8, "big"))
        with pytest.raises(ChildLost, match="past"):
            grading_child.receive(read_end)
        os.close(write_end)
        with pytest.raises(ChildLost, match="ended"):
            grading_child.receive(read_end)
    finally:
        os.close(read_end)


# A solved notebook of the checkout: the kit, as far as the child knows.
SOLVED = str(
    Path(__file__).parents[1] / "notebooks" / "03_rewards_and_advantages.ipynb"
)


def _probe_routes() -> dict:
    """In the confined child: which routes out are open."""
    import ctypes
    import socket

    def opens(route) -> bool:
        try:
            route()
        except Exception:
            return False
        return True

    def many_processes() -> None:
        born = []
        try:
            for _ in range(300):
                pid = os.fork()
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                born.append(pid)
        finally:
            for pid in born:
                os.kill(pid, 9)
                os.waitpid(pid, 0)

    parent = os.getppid()
    return {
        "300 processes": opens(many_processes),
        "parent's command line": opens(lambda: open(f"/proc/{parent}/cmdline").read()),
        "parent's memory": opens(lambda: open(f"/proc/{parent}/mem", "rb").close()),
        "ptrace": ctypes.CDLL(None).ptrace(16, parent, 0, 0) == 0,
        "signal": opens(lambda: os.kill(parent, 0)),
        "tcp": opens(lambda: socket.create_connection(("127.0.0.1", 1), 1).close()),
        "/dev/shm": opens(lambda: open(f"/dev/shm/grpo-lab-probe-{os.getpid()}", "w")),
        "/tmp": opens(lambda: open(f"/tmp/grpo-lab-probe-{os.getpid()}", "w")),
        "the course's solutions": opens(lambda: open(SOLVED).read()),
        "root again": opens(lambda: os.setuid(0)) and os.getuid() == 0,
        "its own folder": not opens(lambda: open("mine.txt", "w").write("x")),
        "an import": not opens(lambda: __import__("statistics")),
    }


def _serve_probe(_) -> dict:
    serve_function(_probe_routes)
    return {}


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the confinement is Linux's"
)
def test_a_confined_child_has_no_route_out(tmp_path):
    """A child confined to its folder (as the grader confines a student's):
    no route is open, and it still writes there and imports."""
    from grpo_lab.instructor import sandbox

    if sandbox.confinement_gaps():
        pytest.skip(f"not confined here: {sandbox.confinement_gaps()}")
    import tempfile

    workdir = tempfile.mkdtemp(prefix="grpo-lab-grade-")  # as the grader's: 0711
    os.chmod(workdir, 0o711)
    scratch = Path(workdir) / "solution"
    scratch.mkdir()
    pid = os.fork()
    if pid == 0:  # a warden's part: the bridge in a mount namespace of its own
        try:
            sandbox.bridge_for_solutions()
            child = Child({"serve": _serve_probe}, scratch=str(scratch))
            child.ask("serve", None)
            found = RemoteFunction(child, "fn", [])()
            child.stop()
            (tmp_path / "found").write_text(repr(found))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    try:
        found = eval((tmp_path / "found").read_text())
        assert [route for route, open_ in found.items() if open_] == []
        assert (scratch / "mine.txt").read_text() == "x"
    finally:
        shutil.rmtree(workdir)
