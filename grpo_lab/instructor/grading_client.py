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

import os
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
    (``sandbox_prefix``, ending with ``--``), with a :class:`ReadyClient`.

    The connection file (the channels' ports and signing key) is removed as
    soon as it is written: the kernel reads it from a descriptor it inherits
    (``-f /dev/fd/N``), so no command line names it and no process finds it
    on disk. The manager and its client hold the key in memory."""

    sandbox_prefix: ClassVar[list[str]] = []
    client_factory = Type(ReadyClient, klass=AsyncKernelClient)
    connection_descriptor: int | None = None

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        command = super().format_kernel_cmd(extra_arguments)
        path = os.path.realpath(self.connection_file)
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.unlink(path)
        self.connection_descriptor = descriptor
        command = [f"/dev/fd/{descriptor}" if arg == path else arg for arg in command]
        if not self.sandbox_prefix:
            return command
        *options, end = self.sandbox_prefix
        return [*options, "--keep-fd", str(descriptor), end, *command]

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        descriptor = self.connection_descriptor
        if descriptor is not None:
            kw["pass_fds"] = (*kw.get("pass_fds", ()), descriptor)
        try:
            await super()._async_launch_kernel(kernel_cmd, **kw)
        finally:
            if descriptor is not None:
                os.close(descriptor)
                self.connection_descriptor = None
            # jupyter_client writes the file again once the kernel is launched.
            self.cleanup_connection_file()
