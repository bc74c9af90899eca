"""A JSON schema's automaton built in a child process that can be stopped.

outlines-core builds an index in Rust, and nothing stops it once it has started: a small schema
whose regular expression blows up (`.*a.{20}`, a long minLength) can hold a thread and gigabytes
for hours. So the build runs in a child Python (`python -m lmfoundry.serving.grammar_compile`,
which imports nothing but outlines-core) under an address-space limit, and is killed at its
deadline; the schema and the vocabulary go in pickled on its stdin, the index comes back pickled
on its stdout. Starting the child costs 0.06-0.2 s, by machine; only a schema missing from the
cache pays it. A plain child, not a multiprocessing one: those import the parent's __main__ again
(a Ray worker's, a script's), and a fork of a server's threads could inherit a held lock.
"""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
from pathlib import Path

# A build's address space: far above what the transition limit lets a kept automaton use
COMPILE_MEMORY_BYTES = 2 << 30


class CompilerFailed(RuntimeError):
    """The compile process failed for a reason of the server's (it could not start, import, or
    answer), not the schema's: a 503, never a 400 that blames the client."""


def build_index(
    schema_json: str,
    whitespace: str,
    vocabulary: bytes,
    max_transitions: int,
    timeout_s: float,
    memory: int = COMPILE_MEMORY_BYTES,
):
    """(index, transitions) of the schema's regular expression over `vocabulary` (an outlines-core
    Vocabulary, pickled once by the caller), or the reason it was refused: over the transition limit, uncompilable, over
    `memory` (the child killed by its allocator's abort), or not done within `timeout_s` (the
    child is killed then, so its thread, its slot and its memory come back at once).
    CompilerFailed when the child failed otherwise."""
    request = pickle.dumps((schema_json, whitespace, vocabulary, max_transitions, memory))
    # this package where the parent found it, whether installed or on a path a job set
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__],
            input=request,
            capture_output=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"the schema did not compile within {timeout_s} s (compile timeout)"
    said = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    if done.returncode < 0:  # a signal: Rust aborts when an allocation fails under the limit
        return f"compiling the schema took more than {memory >> 20} MiB (the compile was stopped by signal {-done.returncode})"
    try:
        if done.returncode != 0:
            raise ValueError(f"exit code {done.returncode}")
        result = pickle.loads(done.stdout)  # from the child this module started, not from a client
        return (result[1], result[2]) if result[0] == "ok" else result[1]
    except Exception as e:
        raise CompilerFailed(f"the schema compile process failed ({e}; {said[0][:200]})") from None


def _main() -> None:
    """In the child: ("ok", index, transitions) or ("refused", why), pickled to the stdout it was
    started with; anything else written to stdout (a library's print) goes to stderr instead."""
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    schema_json, whitespace, vocabulary, max_transitions, memory = pickle.loads(sys.stdin.buffer.read())
    vocabulary = pickle.loads(vocabulary)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    try:
        index = Index(build_regex_from_schema(schema_json, whitespace), vocabulary)
        transitions = sum(len(t) for t in index.get_transitions().values())
        if transitions > max_transitions:
            result = (
                "refused",
                f"the schema compiles to an automaton of {transitions} transitions; the limit is {max_transitions}",
            )
        else:
            result = ("ok", index, transitions)
    except MemoryError:
        result = ("refused", f"compiling the schema took more than {memory >> 20} MiB")
    except Exception as e:  # the Rust side raises plain ValueErrors/RuntimeErrors with its reason
        result = ("refused", f"the JSON schema cannot be compiled for constrained decoding: {e}")
    answer.write(pickle.dumps(result))
    answer.close()


if __name__ == "__main__":
    _main()
