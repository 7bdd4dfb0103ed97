"""Tools of a multi-turn episode: the user's functions named in `env.tools`, their JSON schemas, and one call run
under a timeout, its result (or its error) turned into the text the model reads back.

    grpo train env=tools 'env.tools=[my_tools.calculator,path/to/tools.py:search]'

A tool is a plain function, sync or `async def`, with a type hint on every parameter and a Google-style docstring
(a description, then an `Args:` line per parameter). transformers' `get_json_schema` turns it into the schema that
chat templates and TRL read, and refuses anything less; such a tool stops the run before the model loads, with one
line naming the fix. Names resolve as reward functions' do (grpo_cli.user_code.load_function): `module.fn`
with the working directory first on sys.path, or `path/to/file.py:fn`.

During an episode a call goes as it goes in TRL's GRPOTrainer (its tool loop, trl/trainer/grpo_trainer.py): a
function that raises, or a name that is no tool, gets `{'error': '...'}` back as its result and counts as a
failure; a result that is not a string is converted with `str()` (a dict reads as its repr, bytes as `b'...'`, None
as "None"), not refused. Two limits TRL does not set: a call still running after `env.tool_timeout_s` gets an
error result, and a result longer than `env.max_result_chars` is cut, with a note saying how much the model sees;
both count as failures. The result's text is made (`str()`) and cut inside the bounded call, where the tool runs:
a result whose `__str__` hangs is a call that timed out. What a tool prints (Python's stdout and stderr) reaches
the console up to `PRINT_CHARS` characters a call, then one line says how much was not shown. `async def` tools
run on one event loop per process for the whole run (`event_loop`), not a new one per call, so a client they
open stays usable.

Where a call runs:
- `env=tools` (and `env.tools` beside an environment class): in the environment's worker process
  (grpo_cli.workers), one per environment, forked with it before the model loads, calls one at a time. A call past
  the timeout is killed with its worker and the next call gets a new one, so nothing hung piles up or holds a CPU;
  a tool that ends its process (`os._exit`, a crash) costs its call only. Only the cut text comes back over the
  pipe. Where the platform cannot fork, calls run in threads, as below.
- `env=class` methods: in a thread of this process. The methods share the state of their instance, which the next
  call, `get_reward` and the reward functions read (`environments`), so the instance has to live where they run:
  in this process. A worker's copy of it would not be the instance the rewards read, and need not pickle. What is
  contained there: a raise or `sys.exit` (an error result), `os._exit` (an error result: it raises in the tool's
  thread instead of ending the process), prints (bounded as above), an async method past the timeout (cancelled
  on the loop), and a sync method past the timeout that runs Python code (`TimedOut` is raised in its thread,
  which Python delivers between bytecodes: a loop that spins stops, instead of holding a core and the GIL for the
  rest of the run). What is not: a thread cannot be killed, so a sync call blocked in C code (a sleep, a socket
  read) runs on until that returns; while it does, that method (of any instance) is not called again and its calls
  get an error at once, so hung calls hold at most one thread per method. A crash of the interpreter (a segfault
  in a C extension), a C library's own exit or its writes to the file descriptors, and C code that holds the GIL
  still reach the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from grpo_cli import workers
from grpo_cli.env.limits import Limits
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.user import BUILTINS
from grpo_cli.user_code import load_function

HOW = ("a tool needs a type hint on every parameter and a docstring with a description and an Args: line per "
       "parameter (transformers' get_json_schema reads them)")


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name`; `schema` is what the prompt shows it."""

    name: str
    fn: Callable
    schema: dict


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the model's text: `error` is set when it could not be read (bad JSON, no name)."""

    name: str
    arguments: Any = None
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What goes back to the model in a `tool` turn, and whether the call counts as a failure."""

    name: str
    text: str
    failed: bool


def schema_of(fn: Callable, where: str) -> dict:
    """transformers' JSON schema of `fn`, or one line naming what to add."""
    try:
        return get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException, or a hint it cannot map
        raise ConfigError(f"{where}: {err}; {HOW}") from None


def tool_from(fn: Callable, where: str) -> Tool:
    schema = schema_of(fn, where)
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(specs: Any) -> list[Tool]:
    """The tools named in `env.tools`, each checked for a schema; one ConfigError line for the first bad one."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    if not specs:
        raise ConfigError("env.tools is empty; name at least one function: 'env.tools=[my_tools.calculator]' or "
                          "'env.tools=[path/to/tools.py:calculator]'")
    tools: list[Tool] = []
    for i, spec in enumerate(specs):
        where = f"env.tools[{i}] ({spec})"
        if isinstance(spec, str) and spec.strip() in BUILTINS:
            raise ConfigError(f"{where} is a built-in reward, not a tool; name your function as module.function or "
                              f"path/to/file.py:function")
        try:
            _, fn = load_function(spec, f"env.tools[{i}]", BUILTINS)
        except ConfigError as err:  # the shared resolver names reward.funcs in its fixes
            raise ConfigError(str(err).replace("reward.funcs", "env.tools")) from None
        tool = tool_from(fn, where)
        if any(t.name == tool.name for t in tools):
            raise ConfigError(f"{where}: a second tool named {tool.name!r}; the model calls tools by name, so give "
                              f"each function its own name")
        tools.append(tool)
    return tools


@dataclass
class Toolbox:
    """The tools one episode may call (for `env=class`, its environment's methods) and the instance behind them."""

    tools: dict[str, Tool]
    # the environment instance of `env=class` (reward functions read it); None for plain tools
    environment: Any = None
    # the worker process where the tools it holds run (env=tools, and env.tools beside an environment class);
    # every other tool (an environment's method) runs in a thread of this process
    worker: ToolWorker | None = None
    # env=class with get_reward: () -> (the environment's score of the episode, or None with why)
    reward: Callable[[], tuple[float | None, str | None]] | None = None
    schemas: list[dict] = field(init=False)

    def __post_init__(self):
        self.schemas = [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall, timeout_s: float, max_chars: int) -> ToolResult:
        """Run one parsed call; never raises, never waits longer than `timeout_s`."""
        if call.error is not None:
            return ToolResult(call.name, error_text(call.error), True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call.name, error_text(f"no tool named {call.name!r} (the tools: {known})"), True)
        if not isinstance(call.arguments, dict):
            return ToolResult(call.name, error_text(f"the arguments of {call.name} must be a JSON object, got "
                                                f"{json.dumps(call.arguments)}"), True)
        where = self.worker.call if self.worker is not None and tool.name in self.worker.names else run_in_thread
        text, length, error = where(tool, call.arguments, timeout_s, max_chars)
        if error is not None:
            return ToolResult(call.name, error_text(error), True)
        if length > max_chars:
            note = f"\n[cut: the first {max_chars} of {length} characters]"
            return ToolResult(call.name, text + note, True)
        return ToolResult(call.name, text, False)


def error_text(message: str) -> str:
    # TRL's shape: the result is {"error": message}, read back as its str()
    return str({"error": message})


# what a call gives back: (the result's text, cut to max_chars; its full length; None) or (None, 0, the error)
Outcome = tuple[str | None, int, str | None]


def call_tool(fn: Callable, arguments: dict, max_chars: int, pending: list | None = None) -> Outcome:
    """`fn(**arguments)` and its result's text, where the call runs (a worker process or a thread): an `async def`
    tool's coroutine runs on the process's one event loop (`event_loop`), its future put in `pending` so a caller
    that stops waiting can cancel it. What the tool prints reaches the console up to `PRINT_CHARS` characters."""
    with bounded_output(getattr(fn, "__name__", "tool")):
        try:
            out = fn(**arguments)
            if inspect.iscoroutine(out):
                future = asyncio.run_coroutine_threadsafe(out, event_loop())
                if pending is not None:
                    pending.append(future)
                out = future.result()
            value = out
        except EndedProcess as err:
            return None, 0, str(err)
        except BaseException as err:  # a library's sys.exit() is a failed call too, not the end of the run
            return None, 0, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        try:
            text = value if isinstance(value, str) else str(value)
        except BaseException as err:
            return None, 0, f"its result could not be turned into text: {err}"
    return text[:max_chars], len(text), None


# (the loop, the process it runs in): one event loop per process, in a daemon thread of its own, for every
# `async def` tool of the run; a forked worker makes its own (the parent's loop thread is not in the child)
_loop: tuple[asyncio.AbstractEventLoop, int] | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for async tools, started at the first call: a client an async tool opens
    (an HTTP session) stays bound to the loop it was made on, which `asyncio.run` per call would close."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[1] != os.getpid() or _loop[0].is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="tool-event-loop").start()
            _loop = (loop, os.getpid())
        return _loop[0]


# what one call may print to the console; past it, the rest is counted and one line says how much was not shown
PRINT_CHARS = 2000
# per thread: the call's bounded sink for its prints (set while a tool runs), and the process it was set in
_calling = threading.local()


class EndedProcess(BaseException):
    """A tool called os._exit in a thread of the trainer (env=class): its call is stopped, not the run."""


class _Bounded:
    """A call's stdout and stderr together: their first PRINT_CHARS characters reach their streams, the rest are
    counted."""

    def __init__(self):
        self.left, self.dropped = PRINT_CHARS, 0

    def write(self, text: str, stream: Any) -> int:
        shown = text[:max(0, self.left)]
        if shown:
            stream.write(shown)
        self.left -= len(shown)
        self.dropped += len(text) - len(shown)
        return len(text)


class _Routed:
    """sys.stdout or sys.stderr while tools run: a tool thread's writes go to its call's bound, every other
    thread's to the stream as before."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        sink = getattr(_calling, "sink", None)
        if sink is not None and getattr(_calling, "pid", None) == os.getpid():
            return sink.write(text, self._stream)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def bounded_output(name: str):
    """While a tool runs in this thread: its prints bounded (Python-level writes; a C library writing to the file
    descriptor itself is not), and os._exit an exception in this thread (`EndedProcess`) where the thread is not
    the worker's own process to end."""
    for attr in ("stdout", "stderr"):
        if not isinstance(getattr(sys, attr), _Routed):
            setattr(sys, attr, _Routed(getattr(sys, attr)))
    if os._exit is not _guarded_exit:
        os._exit = _guarded_exit
    sink = _Bounded()
    _calling.sink, _calling.pid = sink, os.getpid()
    try:
        yield
    finally:
        _calling.sink = None
        if sink.dropped:
            sys.stderr.write(f"\n[{name} printed {sink.dropped} more characters, not shown]\n")


_real_exit = os._exit


def _guarded_exit(code: int) -> None:
    """os._exit while tools may run: in a tool's thread of the trainer, an exception that stops the call; on a
    main thread (a tools worker process's, where ending the process costs the call only) and in any thread not
    running a tool, the real one."""
    if getattr(_calling, "sink", None) is not None and getattr(_calling, "pid", None) == os.getpid() \
            and threading.current_thread() is not threading.main_thread():
        raise EndedProcess(f"the tool called os._exit({code}), which would end the run; the call was stopped")
    _real_exit(code)


def _late(tool: Tool, timeout_s: float) -> Outcome:
    return None, 0, f"{tool.name} did not return within {timeout_s} s"


def _run_named(fns: dict[str, Callable], name: str, arguments: dict, max_chars: int) -> Outcome:
    return call_tool(fns[name], arguments, max_chars)


class ToolWorker:
    """The tools of one `env=tools` environment, called in a worker process of their own (the module docstring)."""

    def __init__(self, tools: list[Tool]):
        self.names = frozenset(t.name for t in tools)
        work = functools.partial(_run_named, {t.name: t.fn for t in tools})
        self._worker = workers.Worker("tools", work, kind="tool")
        self._lock = threading.Lock()  # one call at a time on its pipe

    def start(self) -> None:
        """Fork the worker now (a call forks it otherwise)."""
        self._worker.start()

    def stop(self) -> None:
        self._worker.stop()

    def call(self, tool: Tool, arguments: dict, timeout_s: float, max_chars: int) -> Outcome:
        with self._lock:
            try:
                return self._worker.call((tool.name, arguments, max_chars), timeout_s)
            except TimeoutError:  # its worker was killed with the call
                return _late(tool, timeout_s)
            except workers.WorkerDied as err:
                return None, 0, f"{tool.name} ended its worker process ({err}); the next call gets a new one"
            except workers.NotSendable as err:
                return None, 0, f"its arguments could not be sent to the tools' worker process: {err}"
            except Exception as err:  # the worker's own failure (call_tool catches the tool's): still the call's only
                return None, 0, f"{type(err).__name__}: {err}"


# per function (a method: its class's function, shared by every instance), the thread of a call that passed its
# timeout and runs on
_running_on: dict[Any, threading.Thread] = {}
_running_on_lock = threading.Lock()
# how long a call's thread is given to stop once TimedOut is raised in it: a thread running Python code sees it
# within the interpreter's switch interval (5 ms)
STOP_WAIT_S = 1.0


class TimedOut(BaseException):
    """Raised inside a tool's thread once its call passed env.tool_timeout_s. A BaseException, so that a tool's own
    `except Exception` does not swallow it."""


def _stop(thread: threading.Thread) -> bool:
    """Raise TimedOut in `thread` and wait up to STOP_WAIT_S for it to end; whether it did. A thread cannot be
    killed, but Python checks for an exception set from outside between bytecodes, so a tool that spins in Python
    code stops here; one blocked in C code (a sleep, a socket read) sees it only when that returns."""
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(TimedOut))
    thread.join(STOP_WAIT_S)
    return not thread.is_alive()


def run_in_thread(tool: Tool, arguments: dict, timeout_s: float, max_chars: int) -> Outcome:
    """One call in a thread of this process, waited for `timeout_s` seconds and then stopped (`_stop`); a call that
    does not stop runs on, and its function is not called again until it ends (the module docstring)."""
    key = getattr(tool.fn, "__func__", tool.fn)
    with _running_on_lock:
        earlier = _running_on.get(key)
        if earlier is not None and earlier.is_alive():
            return None, 0, (f"{tool.name} is still running from an earlier call that passed the timeout "
                             f"({timeout_s} s); this call was not run")
        _running_on.pop(key, None)
    box: dict[str, Outcome] = {}
    pending: list = []  # an async tool's future on the run's event loop

    def target() -> None:
        try:
            box.update(out=call_tool(tool.fn, arguments, max_chars, pending))
        except TimedOut:  # raised after the tool itself had returned: the call was answered as late already
            pass

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        for future in pending:  # a coroutine can be stopped: cancelled on the loop, its thread ends with it
            future.cancel()
        if not pending and not _stop(thread):
            with _running_on_lock:
                _running_on[key] = thread
        return _late(tool, timeout_s)
    return box["out"]


class ToolsEnv:
    """`env=tools` (conf/env/tools.yaml): the same functions in every episode, no first observation."""

    def __init__(self, tools: Any, tool_format: str, max_turns: int, max_tool_calls: int, max_episode_tokens: int,
                 tool_timeout_s: float, max_result_chars: int):
        self.tool_format = tool_format
        self.limits = Limits(max_turns, max_tool_calls, max_episode_tokens, tool_timeout_s, max_result_chars)
        self.tools = load_tools(tools)
        self.schemas = [t.schema for t in self.tools]
        # where every episode's calls run: forked by grpo_cli.env.from_config before the model loads, or at the
        # first call (None where the platform cannot fork: threads)
        self.worker = ToolWorker(self.tools) if workers.available() else None

    def begin(self) -> None:
        """A new batch of episodes: nothing to give back (the same functions serve every episode)."""

    def start(self, row: dict) -> tuple[Toolbox, str | None]:
        return Toolbox({t.name: t for t in self.tools}, worker=self.worker), None

    def close(self) -> None:
        """The end of the run: the tools' worker stopped."""
        if self.worker is not None:
            self.worker.stop()
