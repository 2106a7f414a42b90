"""The student's code in a process of its own; the course's check beside it.

A grading kernel (:mod:`grpo_lab.instructor.grading_kernel`) has run the course's
context cells, all trusted, when it forks a :class:`Child` for the student's
code. The child closes every file descriptor but its two pipes (no result
channel, no kernel sockets), points 0-2 at ``/dev/null``, runs one thread of
torch, and serves requests: the student's cells, then calls of the student's
function. The kernel (the parent) runs the course's check itself, with the
student's function replaced by a :class:`RemoteFunction`:

* a call pickles its arguments (parent to child; the parent is trusted) and the
  child calls the student's function on its copies;
* the child answers with the result and the state of every argument after the
  call (tensors' data and ``.grad``; a module's parameters and buffers; an
  optimizer's state and plain attributes; a plain object's attributes, such as
  the object behind a bound method), which the parent applies to its own
  arguments in place. What the child sends is read with
  ``torch.load(weights_only=True)`` only: tensors, numbers, strings and
  containers, never an object of the child's choosing;
* the call is a :class:`torch.autograd.Function` of the arguments that require
  grad: a backward pass asks the child for the vector-Jacobian product of the
  graph it kept for that call;
* a parameter's post-accumulate-grad hooks (a check that keeps the gradient
  after the last backward) are replayed once with the gradient as it stood
  after the child's last backward.

The parent is made non-dumpable before the fork (``PR_SET_DUMPABLE``), so the
child cannot read the parent's memory or descriptors through ``/proc``. A child
that died, or sent what the parent does not read, is :class:`ChildLost`.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import os
import pickle
import struct
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grpo_lab.instructor.tampering import Tampered

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
# The most bytes one message may carry.
MESSAGE_LIMIT = 1 << 30
# The calls whose graphs the child keeps for a later backward pass.
KEPT_GRAPHS = 256
# How deep the state of an argument is followed (object -> attribute -> ...).
STATE_DEPTH = 3
# The longest text the parent takes from the child.
TEXT_LIMIT = 2000
_HEADER = struct.Struct("!Q")
# Built-in types of a plain result that weights_only reads only when allowed.
_SAFE_BUILTINS = (slice, range, complex)


class ChildLost(RuntimeError):
    """The solution's process died, or sent what the grader does not read."""


class SolutionRaised(Exception):
    """The student's function raised an exception of a type the grader does not
    rebuild; ``type_name`` is the type's name as the child gave it."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


# --- messages ------------------------------------------------------------------


def send(descriptor: int, payload: bytes) -> None:
    """One message: its length, then its bytes."""
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(descriptor, view) :]


def receive(descriptor: int) -> bytes:
    """One message; ChildLost at end of file or past MESSAGE_LIMIT."""
    (length,) = _HEADER.unpack(_read_exactly(descriptor, _HEADER.size))
    if length > MESSAGE_LIMIT:
        raise ChildLost(f"a message of {length} bytes, past {MESSAGE_LIMIT}")
    return _read_exactly(descriptor, length)


def _read_exactly(descriptor: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(descriptor, min(left, 1 << 20))
        if not chunk:
            raise ChildLost("the solution's process ended")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def encode(value: Any) -> bytes:
    """``value`` (tensors, numbers, strings, containers) as torch.save writes it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(payload: bytes) -> Any:
    """What the child sent, read with weights_only (ChildLost if refused)."""
    try:
        with torch.serialization.safe_globals(list(_SAFE_BUILTINS)):
            return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as error:
        raise ChildLost(
            f"the solution's process sent what the grader does not read "
            f"({type(error).__name__})"
        ) from None


# --- the parent's arguments, pickled --------------------------------------------


def _rebuilt_tensor(
    data: torch.Tensor, requires_grad: bool, grad: torch.Tensor | None, kind: str
) -> torch.Tensor:
    tensor: torch.Tensor = (
        torch.nn.Parameter(data, requires_grad=requires_grad)
        if kind == "parameter"
        else data.requires_grad_(requires_grad)
    )
    tensor.grad = grad
    return tensor


def _rebuilt_optimizer(
    kind: type, state: dict[str, Any], attributes: dict[str, Any]
) -> torch.optim.Optimizer:
    optimizer = kind.__new__(kind)
    optimizer.__setstate__(state)
    optimizer.__dict__.update(attributes)
    return optimizer


def _from_dill(payload: bytes) -> Any:
    import dill

    return dill.loads(payload)


class _ArgumentPickler(pickle.Pickler):
    """Tensors without their hooks or graph (a leaf with the same data,
    ``requires_grad`` and ``.grad``); optimizers with their own attributes."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and not _clean(obj):
            kind = "parameter" if isinstance(obj, torch.nn.Parameter) else "tensor"
            grad = None if obj.grad is None else obj.grad.detach()
            return _rebuilt_tensor, (obj.detach(), obj.requires_grad, grad, kind)
        if isinstance(obj, torch.optim.Optimizer):
            state = obj.__getstate__()
            own = {
                k: v
                for k, v in vars(obj).items()
                if not k.startswith("_") and k not in state
            }
            return _rebuilt_optimizer, (type(obj), state, own)
        return NotImplemented


def _clean(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) is torch.Tensor
        and not tensor.requires_grad
        and tensor.grad is None
        and not vars(tensor)
    )


def dumps(value: Any) -> bytes:
    """``value`` pickled for the child (see :class:`_ArgumentPickler`)."""
    buffer = io.BytesIO()
    _ArgumentPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def warm_up() -> None:
    """Pickle and read back what calls will, once: pickling caches names in
    the classes it meets (``__slotnames__``), which the kernel's record must
    hold before it is taken."""
    module = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    leaf = torch.zeros(1, requires_grad=True)
    pickle.loads(dumps((module, optimizer, leaf, leaf * 2, torch.zeros(1))))
    decode(encode({"state": state_of(module), "value": [torch.zeros(1), 1.0]}))


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``value`` and of its lists, tuples and dicts, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif type(value) in (list, tuple):
        for item in value:
            yield from tensors_in(item)
    elif type(value) is dict:
        for item in value.values():
            yield from tensors_in(item)


def _rebuilt(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``value`` with each of its tensors (as tensors_in finds them) replaced."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if type(value) in (list, tuple):
        return type(value)(_rebuilt(item, tensors) for item in value)
    if type(value) is dict:
        return {key: _rebuilt(item, tensors) for key, item in value.items()}
    return value


# --- the state of an argument after a call --------------------------------------


def state_of(value: Any, depth: int = STATE_DEPTH) -> Any:
    """What a call may have changed in ``value``, as plain data (or None)."""
    if isinstance(value, torch.Tensor):
        grad = None if value.grad is None else value.grad.detach()
        return {"kind": "tensor", "data": value.detach(), "grad": grad}
    if isinstance(value, torch.nn.Module):
        return _module_state(value)
    if isinstance(value, torch.optim.Optimizer):
        return {
            "kind": "optimizer",
            "state": value.state_dict(),
            "attributes": _attributes(value, depth),
        }
    if isinstance(value, types.MethodType):
        return state_of(value.__self__, depth)
    if depth <= 0:
        return None
    if type(value) in (list, tuple):
        return {"kind": "items", "items": [state_of(v, depth - 1) for v in value]}
    if type(value) is dict:
        items = [(k, state_of(v, depth - 1)) for k, v in value.items()]
        return {"kind": "mapping", "items": [(k, s) for k, s in items if _key(k)]}
    if _plain_object(value):
        return {"kind": "object", "attributes": _attributes(value, depth)}
    return None


def _key(key: Any) -> bool:
    return type(key) in (str, int)


def _plain_object(value: Any) -> bool:
    kind = type(value)
    return (
        hasattr(value, "__dict__")
        and kind.__module__ != "builtins"
        and not isinstance(value, (type, types.ModuleType, types.FunctionType))
    )


def _module_state(module: torch.nn.Module) -> dict[str, Any]:
    parameters = []
    for name, parameter in module.named_parameters():
        grad = None if parameter.grad is None else parameter.grad.detach()
        last = vars(parameter).get("_grader_last_grad")
        parameters.append((name, parameter.detach(), grad, last))
    buffers = [(name, buffer.detach()) for name, buffer in module.named_buffers()]
    return {"kind": "module", "parameters": parameters, "buffers": buffers}


def _attributes(value: Any, depth: int) -> dict[str, Any]:
    """The public attributes of ``value``: a tensor, module or optimizer by its
    state, anything else when it is plain data."""
    found = {}
    for name, attribute in vars(value).items():
        if name.startswith("_") or (
            isinstance(value, torch.optim.Optimizer) and name in _OPTIMIZER_OWN
        ):
            continue
        if isinstance(
            attribute, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)
        ):
            found[name] = state_of(attribute, depth - 1)
        elif _plain_data(attribute):
            found[name] = {"kind": "value", "value": _detached(attribute)}
    return found


# An optimizer's own attributes, which its state dict carries.
_OPTIMIZER_OWN = frozenset({"defaults", "state", "param_groups"})


def _plain_data(value: Any, depth: int = 4) -> bool:
    if type(value) in (bool, int, float, str, type(None)):
        return True
    if isinstance(value, torch.Tensor):
        return True
    if depth and type(value) in (list, tuple):
        return all(_plain_data(item, depth - 1) for item in value)
    if depth and type(value) is dict:
        return all(_key(k) and _plain_data(v, depth - 1) for k, v in value.items())
    return False


def _detached(value: Any) -> Any:
    tensors = [t.detach() for t in tensors_in(value)]
    return _rebuilt(value, iter(tensors))


def apply_state(target: Any, state: Any) -> None:
    """Put ``state`` (from :func:`state_of`, in the child) into ``target``."""
    if not isinstance(state, dict):
        return
    kind = state.get("kind")
    if isinstance(target, types.MethodType):
        target = target.__self__
    if kind == "tensor" and isinstance(target, torch.Tensor):
        _apply_tensor(target, state.get("data"), state.get("grad"))
    elif kind == "module" and isinstance(target, torch.nn.Module):
        _apply_module(target, state)
    elif kind == "optimizer" and isinstance(target, torch.optim.Optimizer):
        with contextlib.suppress(Exception):
            target.load_state_dict(state["state"])
        _apply_attributes(target, state.get("attributes"))
    elif kind == "items" and type(target) in (list, tuple):
        for item, item_state in zip(target, state.get("items", ())):
            apply_state(item, item_state)
    elif kind == "mapping" and type(target) is dict:
        for key, item_state in state.get("items", ()):
            if key in target:
                apply_state(target[key], item_state)
    elif kind == "object" and _plain_object(target):
        _apply_attributes(target, state.get("attributes"))


def _apply_tensor(target: torch.Tensor, data: Any, grad: Any) -> None:
    if not isinstance(data, torch.Tensor) or data.shape != target.shape:
        return
    with torch.no_grad():
        if not torch.equal(data.to(target.dtype), target.detach()):
            target.copy_(data)
    if target.is_leaf and (grad is None or _same_shape(grad, target)):
        target.grad = None if grad is None else grad.to(target.dtype)


def _same_shape(value: Any, target: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == target.shape


def _apply_module(module: torch.nn.Module, state: dict[str, Any]) -> None:
    parameters = dict(module.named_parameters())
    for name, data, grad, last in state.get("parameters", ()):
        parameter = parameters.get(name)
        if parameter is None:
            continue
        hooks = getattr(parameter, "_post_accumulate_grad_hooks", None)
        if hooks and _same_shape(last, parameter):
            parameter.grad = last.to(parameter.dtype)
            for hook in list(hooks.values()):
                hook(parameter)
        _apply_tensor(parameter, data, grad)
    buffers = dict(module.named_buffers())
    for name, data in state.get("buffers", ()):
        if name in buffers:
            _apply_tensor(buffers[name], data, None)


def _apply_attributes(target: Any, attributes: Any) -> None:
    """Each attribute ``target`` already has, public, from its state."""
    if not isinstance(attributes, dict):
        return
    own = vars(target)
    for name, state in attributes.items():
        if type(name) is not str or name.startswith("_") or name not in own:
            continue
        if isinstance(state, dict) and state.get("kind") == "value":
            with contextlib.suppress(AttributeError, TypeError):  # frozen
                setattr(target, name, state.get("value"))
        else:
            apply_state(own[name], state)


# --- the child ----------------------------------------------------------------

Handler = Callable[[Any], dict[str, Any]]
# The child's own: the function it calls, and the graphs it keeps for backward.
_served: dict[str, Any] = {"function": None, "graphs": {}}


def serve_function(function: Callable[..., Any] | None) -> None:
    """Make ``function`` the one later "call" requests call (in the child)."""
    _served["function"] = function
    _served["graphs"].clear()


def _become_child(read_end: int, write_end: int) -> None:
    """Drop every descriptor but the two pipes; 0-2 on /dev/null; die with
    the parent (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    keep = sorted((read_end, write_end))
    os.closerange(3, keep[0])
    os.closerange(keep[0] + 1, keep[1])
    os.closerange(keep[1] + 1, 1 << 16)
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in (0, 1, 2):
        os.dup2(null, descriptor)
    os.close(null)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False)  # noqa: SIM115
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
    torch.set_num_threads(1)


def _serve(read_end: int, write_end: int, handlers: dict[str, Handler]) -> None:
    """Answer requests until the parent closes its end; never returns."""
    try:
        while True:
            try:
                kind, payload = pickle.loads(receive(read_end))
            except ChildLost:
                break
            try:
                reply = handlers[kind](payload)
            except BaseException as error:
                reply = {"failure": f"{type(error).__name__}: {error}"[:TEXT_LIMIT]}
            try:
                message = encode(reply)
            except BaseException as error:
                message = encode({"failure": f"unsendable reply ({error})"[:200]})
            send(write_end, message)
    finally:
        os._exit(0)


def _call(payload: dict[str, Any]) -> dict[str, Any]:
    """Call the served function on the pickled arguments; see RemoteFunction."""
    function = _served["function"]
    if function is None:
        return {"failure": "no function to call"}
    args, kwargs = pickle.loads(payload["arguments"])
    torch.set_rng_state(payload["rng"])
    inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
    _record_last_gradients(args, kwargs)
    reply: dict[str, Any] = {"raised": None, "tampered": "", "unplain": ""}
    result = None
    with torch.set_grad_enabled(payload["grad"]):
        try:
            result = function(*args, **kwargs)
        except BaseException as error:
            reply.update(_exception_reply(error))
    outputs = list(tensors_in(result))
    differentiable = [t.requires_grad for t in outputs]
    graphs = _served["graphs"]
    if inputs and any(differentiable):
        graphs[payload["id"]] = (outputs, inputs)
    for old in list(graphs)[:-KEPT_GRAPHS]:
        del graphs[old]
    reply["result"] = (
        _numpy_free(_detached(result)) if reply["raised"] is None else None
    )
    reply["differentiable"] = differentiable
    reply["states"] = [state_of(a) for a in args]
    reply["keyword_states"] = {k: state_of(v) for k, v in kwargs.items()}
    reply["rng"] = torch.get_rng_state()
    return reply


def _exception_reply(error: BaseException) -> dict[str, Any]:
    text = str(error)[:TEXT_LIMIT]
    if isinstance(error, Tampered):
        return {"tampered": text}
    if isinstance(error, ValueError) and "must be built of" in text:
        return {"unplain": text}
    return {"raised": (type(error).__name__[:100], text)}


def _numpy_free(value: Any) -> Any:
    """``value`` with numpy arrays as tensors and numpy scalars as numbers."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(_numpy_free(item) for item in value)
    if kind is dict:
        return {key: _numpy_free(item) for key, item in value.items()}
    if kind.__module__ == "numpy":
        return (
            torch.as_tensor(value)
            if hasattr(value, "shape") and value.shape
            else (value.item())
        )
    return value


def _record_last_gradients(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """On each module argument's parameters: keep the gradient after every
    backward (the parent replays its own hooks with it)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.nn.Module):
            for parameter in value.parameters():
                parameter.register_post_accumulate_grad_hook(_keep_last)


def _keep_last(parameter: torch.Tensor) -> None:
    parameter._grader_last_grad = parameter.grad.detach().clone()  # type: ignore[attr-defined]


def _vjp(payload: dict[str, Any]) -> dict[str, Any]:
    outputs, inputs = _served["graphs"].get(payload["id"], ([], []))
    pairs = [
        (output, cotangent)
        for output, cotangent in zip(outputs, payload["cotangents"])
        if output.requires_grad and cotangent is not None
    ]
    if not pairs or not inputs:
        return {"grads": [None] * len(payload["inputs"])}
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        inputs,
        [c for _, c in pairs],
        allow_unused=True,
        retain_graph=True,
    )
    return {"grads": [None if g is None else g.detach() for g in grads]}


def _dill(payload: Any) -> dict[str, Any]:
    import dill

    function = _served["function"]
    data = dill.dumps(getattr(function, "__wrapped__", function), recurse=True)
    return {"payload": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


# --- the parent ----------------------------------------------------------------


def _not_dumpable() -> None:
    """Linux: no process of this user may read this one's memory or descriptors."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


class Child:
    """A forked process that serves ``handlers`` (and calls, backward passes and
    a dill copy of the served function); the parent asks, the child answers."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        on_start: Callable[[], None] | None = None,
    ) -> None:
        handlers = {"call": _call, "vjp": _vjp, "dill": _dill, **handlers}
        _not_dumpable()
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(parent_writes)
                os.close(parent_reads)
                _become_child(child_reads, child_writes)
                if on_start is not None:
                    on_start()
                _serve(child_reads, child_writes, handlers)
            finally:
                os._exit(0)
        os.close(child_reads)
        os.close(child_writes)
        self.pid, self.requests, self.replies = pid, parent_writes, parent_reads
        self.calls = 0
        self.lost = ""

    def ask(self, kind: str, payload: Any) -> dict[str, Any]:
        """The child's reply (a dict) to one request; ChildLost when it cannot
        answer, its reply is unreadable, or it reports a failure."""
        if self.lost:
            raise ChildLost(self.lost)
        try:
            send(self.requests, pickle.dumps((kind, payload)))
            reply = decode(receive(self.replies))
        except (ChildLost, OSError) as error:
            self.lost = f"the solution's process was lost ({error})"[:TEXT_LIMIT]
            raise ChildLost(self.lost) from None
        if not isinstance(reply, dict):
            raise ChildLost("the solution's process sent a reply of the wrong kind")
        if "failure" in reply:
            raise ChildLost(f"the solution's process failed: {_text(reply['failure'])}")
        return reply

    def stop(self) -> None:
        """Kill the child and wait for it."""
        for descriptor in (self.requests, self.replies):
            with contextlib.suppress(OSError):
                os.close(descriptor)
        with contextlib.suppress(OSError):
            os.kill(self.pid, 9)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)
        self.lost = self.lost or "the solution's process was stopped"


def _text(value: Any) -> str:
    return str(value)[:TEXT_LIMIT] if type(value) is str else "(not text)"


def solution_error(raised: Any) -> Exception:
    """The parent's own exception for what the student's function raised: a
    built-in type of that name, the check's ExerciseFailed, or SolutionRaised."""
    from grpo_lab.teaching.checks.framework import ExerciseFailed

    if type(raised) not in (list, tuple) or len(raised) != 2:
        return ChildLost("the solution's process sent an exception of the wrong kind")
    name, message = _text(raised[0]), _text(raised[1])
    if name == "ExerciseFailed":
        return ExerciseFailed(message)
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        with contextlib.suppress(Exception):
            return kind(message)
    return SolutionRaised(name, message)


class _Remote(torch.autograd.Function):
    """A remote call as an autograd function of the arguments that need grad."""

    @staticmethod
    def forward(ctx: Any, call: _RemoteCall, *inputs: torch.Tensor) -> Any:
        outputs = call.forward()
        ctx.call = call
        ctx.mark_non_differentiable(
            *[o for o, d in zip(outputs, call.differentiable) if not d]
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> Any:
        return (None, *ctx.call.backward(cotangents))


class _RemoteCall:
    """One call of the student's function in the child."""

    def __init__(self, child: Child, args: tuple, kwargs: dict, inputs: list) -> None:
        child.calls += 1
        self.child, self.id = child, child.calls
        self.args, self.kwargs, self.inputs = args, kwargs, inputs
        self.grad = torch.is_grad_enabled()
        self.reply: dict[str, Any] = {}
        self.differentiable: list[bool] = []

    def forward(self) -> list[torch.Tensor]:
        """Ask the child; the result's tensors (ChildLost on a malformed reply)."""
        payload = {
            "id": self.id,
            "arguments": dumps((self.args, self.kwargs)),
            "grad": self.grad,
            "rng": torch.get_rng_state(),
        }
        self.reply = reply = self.child.ask("call", payload)
        outputs = list(tensors_in(reply.get("result")))
        differentiable = reply.get("differentiable")
        if not isinstance(differentiable, list) or len(differentiable) != len(outputs):
            raise ChildLost("the solution's process sent a malformed result")
        self.differentiable = [
            bool(d) and o.is_floating_point() for d, o in zip(differentiable, outputs)
        ]
        return outputs

    def backward(self, cotangents: tuple) -> list[torch.Tensor | None]:
        request = {
            "id": self.id,
            "cotangents": list(cotangents),
            "inputs": len(self.inputs),
        }
        reply = self.child.ask("vjp", request)
        grads = reply.get("grads")
        if not isinstance(grads, list) or len(grads) != len(self.inputs):
            raise ChildLost("the solution's process sent malformed gradients")
        return [
            g.to(i.dtype) if _same_shape(g, i) else None
            for g, i in zip(grads, self.inputs)
        ]

    def finish(self) -> Exception | None:
        """Apply the arguments' state after the call; the exception the student's
        function raised, if any. Raises Tampered (the child's guard saw a change)
        and ValueError (a result not built of plain types)."""
        reply = self.reply
        for argument, state in zip(self.args, _list(reply.get("states"))):
            apply_state(argument, state)
        states = reply.get("keyword_states")
        for name, state in states.items() if isinstance(states, dict) else ():
            if name in self.kwargs:
                apply_state(self.kwargs[name], state)
        with contextlib.suppress(Exception):
            torch.set_rng_state(reply["rng"])
        if reply.get("tampered"):
            raise Tampered(_text(reply["tampered"]))
        if reply.get("unplain"):
            raise ValueError(_text(reply["unplain"]))
        raised = reply.get("raised")
        return None if raised is None else solution_error(raised)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


class RemoteFunction:
    """Stands in the parent for the student's function served by ``child``.

    ``raised`` collects the exceptions made for what the student's function
    raised (the verdict tells them from the check's own)."""

    def __init__(self, child: Child, name: str, raised: list) -> None:
        self.child, self.__name__, self.raised = child, name, raised

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = []
        if torch.is_grad_enabled():
            inputs = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        call = _RemoteCall(self.child, args, kwargs, inputs)
        outputs = _Remote.apply(call, *inputs) if inputs else call.forward()
        raised = call.finish()
        if raised is not None:
            self.raised.append(raised)
            raise raised
        return _rebuilt(call.reply.get("result"), iter(outputs))

    def __reduce__(self) -> tuple[Any, ...]:
        """A dill copy of the student's function, made in the child (for a check
        that calls it in a fresh process; the parent never loads it)."""
        reply = self.child.ask("dill", None)
        payload = reply.get("payload")
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise ChildLost("the solution's process sent a malformed copy")
        return _from_dill, (payload.numpy().tobytes(),)
