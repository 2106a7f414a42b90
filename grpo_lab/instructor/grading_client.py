"""The grader's kernel manager and client: a contained kernel, ready as soon
as it answers.

:class:`ContainedKernelManager` starts the kernel command under the sandbox's
warden (:mod:`grpo_lab.instructor.sandbox`) and hands out a :class:`ReadyClient`.

jupyter_client's ``wait_for_ready`` sits idle twice after the kernel has
answered ``kernel_info``: it waits up to 0.2 s for an IOPub message (to see
that IOPub is connected), then drains IOPub until 0.2 s pass without one. That
is at least 0.2 s a kernel in which nothing runs, and the grader starts one
kernel per submitted notebook. :class:`ReadyClient` asks the same questions
with short waits: it resends ``kernel_info`` until the reply arrives *and* an
IOPub message follows within :data:`IOPUB_PROBE` seconds, then drains only
what IOPub already holds (a late status message is never mistaken for a
cell's: every reader filters by its request's id).
"""

from __future__ import annotations

import time
from queue import Empty
from typing import Any, ClassVar

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager
from traitlets import Type

# Seconds to wait for an IOPub message after the kernel_info reply: the
# kernel publishes its status before it replies, so a connected IOPub already
# holds one; an empty IOPub means not yet subscribed, and kernel_info is resent.
IOPUB_PROBE = 0.02
# Seconds to wait for one kernel_info reply before asking again.
REPLY_WAIT = 1.0


class ReadyClient(AsyncKernelClient):
    """An AsyncKernelClient whose ``wait_for_ready`` does not sleep."""

    async def _ready_without_idling(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
        while True:
            self.kernel_info()
            reply = await self._reply_or_none(self.shell_channel, REPLY_WAIT)
            answered = reply is not None and reply["msg_type"] == "kernel_info_reply"
            if answered and await self._reply_or_none(self.iopub_channel, IOPUB_PROBE):
                self._handle_kernel_info_reply(reply)
                break
            if not await self._async_is_alive():
                raise RuntimeError("Kernel died before replying to kernel_info")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")
        while await self._reply_or_none(self.iopub_channel, 0) is not None:
            pass  # what IOPub holds now: the status messages of kernel_info

    @staticmethod
    async def _reply_or_none(channel: Any, timeout: float) -> dict | None:
        try:
            return await channel.get_msg(timeout=timeout)
        except Empty:
            return None

    wait_for_ready = _ready_without_idling


class ContainedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command runs under the sandbox's warden
    (``sandbox_prefix``), with a :class:`ReadyClient`."""

    sandbox_prefix: ClassVar[list[str]] = []
    client_factory = Type(ReadyClient, klass=AsyncKernelClient)

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return self.sandbox_prefix + super().format_kernel_cmd(extra_arguments)
