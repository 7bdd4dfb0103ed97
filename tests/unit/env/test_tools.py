"""Tools: resolved as reward functions are, refused on one line without type hints or docstring, and a call that
raises, hangs, returns a non-string or a megabyte is an answer to the model, never an exception."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time

import pytest

from grpo_cli.env.tools import Toolbox, ToolCall, ToolResult, ToolsEnv, load_tools, tool_from
from grpo_cli.errors import ConfigError
from tests.helpers.tools import MULTIPLY_TOOL

TOOLS_PY = '''
import asyncio
import os
import time


''' + MULTIPLY_TOOL + '''

async def slow_echo(text: str, seconds: float) -> str:
    """Echo text after a pause.

    Args:
        text: what to echo
        seconds: how long to wait first
    """
    await asyncio.sleep(seconds)
    return text


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def as_dict(key: str) -> dict:
    """A dict.

    Args:
        key: its one key
    """
    return {key: 1}


def huge(n: int) -> str:
    """A long text.

    Args:
        n: its length
    """
    return "x" * n


class SlowText:
    def __str__(self):
        time.sleep(3)
        return "late"


def slow_text(tag: str):
    """A result whose text takes 3 s to make.

    Args:
        tag: unused
    """
    return SlowText()


def exits(code: int) -> str:
    """End the process.

    Args:
        code: the exit code
    """
    os._exit(code)


def as_bytes(n: int) -> bytes:
    """Bytes.

    Args:
        n: how many
    """
    return b"\\x00" * n


def nothing(tag: str) -> None:
    """Returns nothing.

    Args:
        tag: unused
    """
    return None


def chatty(n: int) -> str:
    """Prints n characters, then answers.

    Args:
        n: how many to print
    """
    print("x" * n)
    return "done"


async def which_loop(tag: str) -> str:
    """The id of the event loop it runs on.

    Args:
        tag: unused
    """
    return str(id(asyncio.get_running_loop()))


def no_hints(a, b):
    """Multiply.

    Args:
        a: the first
        b: the second
    """
    return a * b


def no_docstring(a: int) -> int:
    return a
'''


@pytest.fixture()
def tools_py(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(TOOLS_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_tools", raising=False)
    return tmp_path


def toolbox(*names: str) -> Toolbox:
    """The tools called in threads of this process, as an environment class's methods are."""
    return Toolbox({t.name: t for t in load_tools([f"my_tools.py:{n}" for n in names])})


def env_toolbox(*names: str) -> Toolbox:
    """The toolbox of an `env=tools` episode: its calls run in the environment's worker process."""
    return ToolsEnv([f"my_tools.py:{n}" for n in names], "auto", 4, 8, 512, 10, 4000).start({"prompt": "p"})[0]


def test_a_tool_resolves_as_module_fn_or_file_fn_with_transformers_schema(tools_py):
    by_module, by_file = load_tools(["my_tools.multiply", "my_tools.py:slow_echo"])
    assert (by_module.name, by_file.name) == ("multiply", "slow_echo")
    assert by_module.schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first factor"},
        "b": {"type": "integer", "description": "the second factor"}}


@pytest.mark.parametrize("spec, expected", [
    ("my_tools.no_hints", "env.tools[0] (my_tools.no_hints): Argument a is missing a type hint"),
    ("my_tools.no_docstring", "env.tools[0] (my_tools.no_docstring): Cannot generate JSON schema for no_docstring "
                              "because it has no docstring"),
    ("my_tools.divide", "env.tools[0]: my_tools has no 'divide'"),
    ("nowhere.fn", "env.tools[0]: no module named 'nowhere'"),
    ("accuracy", "env.tools[0] (accuracy) is a built-in reward, not a tool"),
], ids=["no-type-hints", "no-docstring", "no-such-function", "no-such-module", "a-reward-builtin"])
def test_a_bad_tool_is_one_line_naming_the_fix(tools_py, spec, expected):
    with pytest.raises(ConfigError) as err:
        load_tools([spec])
    line = str(err.value)
    assert "\n" not in line and line.startswith(expected), line
    assert "reward.funcs" not in line
    assert "type hint" in line or "name your function" in line or "env.tools" in line


def test_no_tool_at_all_names_the_setting(tools_py):
    with pytest.raises(ConfigError, match=r"env.tools is empty; name at least one function"):
        load_tools([])


def test_two_tools_of_one_name_are_refused(tools_py):
    with pytest.raises(ConfigError, match="a second tool named 'multiply'"):
        load_tools(["my_tools.multiply", "my_tools.py:multiply"])


def test_a_call_returns_its_result_as_text(tools_py):
    result = toolbox("multiply").call(ToolCall("multiply", {"a": 456, "b": 123}), 5.0, 4000)
    assert (result.text, result.failed) == ("56088", False)


def test_an_async_tool_runs_to_its_result(tools_py):
    result = toolbox("slow_echo").call(ToolCall("slow_echo", {"text": "hi", "seconds": 0.01}), 5.0, 4000)
    assert (result.text, result.failed) == ("hi", False)


@pytest.mark.parametrize("name, arguments", [("hang", {"seconds": 30}), ("slow_echo", {"text": "x", "seconds": 30})],
                         ids=["sync", "async"])
@pytest.mark.parametrize("where", ["worker process", "thread"])
def test_a_hanging_tool_times_out_as_a_failure(tools_py, name, arguments, where):
    box = env_toolbox(name) if where == "worker process" else toolbox(name)
    begin = time.monotonic()
    result = box.call(ToolCall(name, arguments), 0.2, 4000)
    assert time.monotonic() - begin < 5
    assert result.failed and result.text == str({"error": f"{name} did not return within 0.2 s"})


def test_a_non_string_result_is_converted_with_str_as_trl_does(tools_py):
    result = toolbox("as_dict").call(ToolCall("as_dict", {"key": "k"}), 5.0, 4000)
    assert (result.text, result.failed) == ("{'k': 1}", False)


@pytest.mark.parametrize("where", ["worker process", "thread"])
def test_a_megabyte_result_is_cut_with_a_note(tools_py, where):
    # in a worker process the text is cut there: 100 characters come back over its pipe, not a megabyte
    box = env_toolbox("huge") if where == "worker process" else toolbox("huge")
    result = box.call(ToolCall("huge", {"n": 1_000_000}), 5.0, 100)
    assert result.failed and result.text == "x" * 100 + "\n[cut: the first 100 of 1000000 characters]"


def test_wrong_arguments_are_an_error_back_to_the_model(tools_py):
    box = toolbox("multiply")
    missing = box.call(ToolCall("multiply", {"a": 1}), 5.0, 4000)
    not_object = box.call(ToolCall("multiply", [1, 2]), 5.0, 4000)
    assert missing.failed and "TypeError" in missing.text and "missing 1 required positional argument" in missing.text
    assert not_object.failed and "must be a JSON object" in not_object.text


def test_a_tool_that_exits_the_process_is_a_failed_call(tools_py):
    def exits(code: int) -> str:
        """Exit.

        Args:
            code: the exit code
        """
        raise SystemExit(code)

    result = Toolbox({"exits": tool_from(exits, "test")}).call(ToolCall("exits", {"code": 3}), 5.0, 4000)
    assert result.failed and result.text == str({"error": "SystemExit: 3"})


def test_env_tools_node_builds_from_its_settings(tools_py):
    env = ToolsEnv(["my_tools.multiply"], "auto", 4, 8, 512, 10, 4000)
    box, observation = env.start({"prompt": "p"})
    assert observation is None and list(box.tools) == ["multiply"] and env.limits.max_turns == 4


def test_calls_to_a_tool_that_never_returns_leave_no_thread_or_process_behind(tools_py):
    box = env_toolbox("hang")
    threads, processes = threading.active_count(), len(multiprocessing.active_children())
    for _ in range(4):  # one call per episode
        result = box.call(ToolCall("hang", {"seconds": 3600}), 0.2, 4000)
        assert result.failed and result.text == str({"error": "hang did not return within 0.2 s"})
    # each timed-out call's worker was killed with its call: no thread is left running, and at most one worker lives
    assert threading.active_count() <= threads
    assert len(multiprocessing.active_children()) <= processes + 1


@pytest.mark.parametrize("where", ["worker process", "thread"])
def test_str_of_a_result_runs_inside_the_timeout(tools_py, where):
    box = env_toolbox("slow_text") if where == "worker process" else toolbox("slow_text")
    begin = time.monotonic()
    result = box.call(ToolCall("slow_text", {"tag": "t"}), 0.2, 4000)
    # the result's __str__ takes 3 s: the call is bounded by the timeout all the same
    assert time.monotonic() - begin < 2
    assert result.failed and result.text == str({"error": "slow_text did not return within 0.2 s"})


def test_a_tool_that_ends_its_process_costs_its_call_only(tools_py):
    box = env_toolbox("exits", "multiply")
    result = box.call(ToolCall("exits", {"code": 3}), 5.0, 4000)
    assert result.failed and result.text == str({"error": "exits ended its worker process (exit code 3); the next "
                                                          "call gets a new one"})
    # the run goes on: the next call is answered by a new worker
    assert box.call(ToolCall("multiply", {"a": 6, "b": 7}), 5.0, 4000) == ToolResult("multiply", "42", False)


def test_a_hung_environment_method_does_not_pile_up_threads():
    class Stuck:
        def wait(self, seconds: float) -> str:
            """Wait.

            Args:
                seconds: how long
            """
            time.sleep(seconds)
            return "done"

    threads = threading.active_count()
    results = []
    for _ in range(4):  # env=class: one instance per episode, its methods called in threads of this process
        instance = Stuck()
        box = Toolbox({"wait": tool_from(instance.wait, "test")}, environment=instance)
        results.append(box.call(ToolCall("wait", {"seconds": 2.0}), 0.1, 4000))
    assert all(r.failed for r in results)
    assert results[0].text == str({"error": "wait did not return within 0.1 s"})
    # the first call's thread still runs; the method is not called again until it ends
    assert results[1].text == str({"error": "wait is still running from an earlier call that passed the timeout "
                                            "(0.1 s); this call was not run"})
    assert threading.active_count() <= threads + 1


def test_an_environment_method_that_spins_is_stopped_at_the_timeout():
    class Spinning:
        def __init__(self):
            self.spins = 0

        def spin(self, forever: bool) -> str:
            """Loop in Python code, catching what it can.

            Args:
                forever: whether to loop forever
            """
            while forever:
                try:
                    self.spins += 1
                except Exception:  # a tool's own broad except does not swallow the stop
                    pass
            return "done"

    instance = Spinning()
    box = Toolbox({"spin": tool_from(instance.spin, "test")}, environment=instance)
    threads = threading.active_count()
    result = box.call(ToolCall("spin", {"forever": True}), 0.2, 4000)
    assert result.failed and result.text == str({"error": "spin did not return within 0.2 s"})
    # the thread ended with the call (before the fix it spun on, holding a core and the GIL for the rest of the run)
    assert threading.active_count() == threads
    spins = instance.spins
    time.sleep(0.1)
    assert instance.spins == spins
    # and the method is called again: not "still running from an earlier call"
    assert box.call(ToolCall("spin", {"forever": False}), 5.0, 4000) == ToolResult("spin", "done", False)


def test_the_tools_worker_is_forked_when_the_run_builds_its_environment(tools_py):
    from grpo_cli.env import from_config
    from tests.helpers.runs import tiny_cfg

    # forked while the command is small, before the model loads (a reward's worker is, for the same reason:
    # grpo_cli.rewards.guard), not at the first call of step 1
    env = from_config(tiny_cfg("env=tools", "env.tools=[my_tools.multiply]"))
    try:
        assert env.worker._worker._process.is_alive()
    finally:
        env.worker.stop()


@pytest.mark.parametrize("where", ["worker process", "thread"])
@pytest.mark.parametrize("name, arguments, text", [
    ("as_dict", {"key": "k"}, "{'k': 1}"),
    ("as_bytes", {"n": 2}, "b'\\x00\\x00'"),
    ("nothing", {"tag": "t"}, "None"),
], ids=["dict", "bytes", "none"])
def test_a_result_that_is_not_text_reads_as_its_str_as_trl_does(tools_py, where, name, arguments, text):
    box = env_toolbox(name) if where == "worker process" else toolbox(name)
    assert box.call(ToolCall(name, arguments), 5.0, 4000) == ToolResult(name, text, False)


@pytest.mark.parametrize("where", ["worker process", "thread"])
def test_a_tool_that_prints_megabytes_reaches_the_console_bounded_and_the_call_is_answered(tools_py, where, capfd):
    from grpo_cli.env.tools import PRINT_CHARS

    box = env_toolbox("chatty") if where == "worker process" else toolbox("chatty")
    result = box.call(ToolCall("chatty", {"n": 5_000_000}), 30.0, 4000)
    assert result == ToolResult("chatty", "done", False)
    out, err = capfd.readouterr()
    assert out.count("x") + err.count("x") <= PRINT_CHARS + 10
    assert f"[chatty printed {5_000_001 - PRINT_CHARS} more characters, not shown]" in err


def test_a_method_that_calls_os_exit_in_a_thread_costs_its_call_not_the_run(tools_py):
    # env=class methods run in threads of the trainer: os._exit there would end the run; it is an error result
    box = toolbox("exits", "multiply")
    result = box.call(ToolCall("exits", {"code": 3}), 5.0, 4000)
    assert result.failed and result.text == str({"error": "the tool called os._exit(3), which would end the run; "
                                                          "the call was stopped"})
    assert box.call(ToolCall("multiply", {"a": 6, "b": 7}), 5.0, 4000) == ToolResult("multiply", "42", False)


@pytest.mark.parametrize("where", ["worker process", "thread"])
def test_async_tools_share_one_event_loop(tools_py, where):
    box = env_toolbox("which_loop") if where == "worker process" else toolbox("which_loop")
    loops = {box.call(ToolCall("which_loop", {"tag": str(i)}), 5.0, 4000).text for i in range(3)}
    assert len(loops) == 1  # asyncio.run per call would make three
