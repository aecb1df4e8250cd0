"""What the installed llama-cpp-python build can do, asked without loading a draft in this process.

Glossary:
- *available*: llama-cpp-python imports.
- *fast build*: on x86 a build with AVX-512 kernels, the only kind where a llama.cpp draft beats
  the int8 path on these CPUs (``llamacpp_fast``).
- *probe*: decoding a few tokens of the draft file in a child process (``llamacpp_problem``): a
  build compiled for CPU features the process may not use dies inside llama.cpp, which a probe
  turns into a message; the verdict is cached per build and file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llamacpp_fast() -> bool:
    """Whether this build is the fast draft path: on x86 only a build with AVX-512 kernels.

    Measured on an AVX2-only build (docs/runners.md): a 0.5B draft token cost about
    what the int8 path costs (41-44 ms against 45-50 ms) and a 160-token prompt prefill 1.07 s
    against 0.26 s, so the int8 draft won (1.26x against 1.20x over plain decoding). With the
    native AVX-512 build of the first machine llama.cpp drafted at 28 ms against 42 ms and won
    (1.52x against 1.20x)."""
    import llama_cpp

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    return "AVX512 = 1" in info


_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"def f(x):"))
"""


def llamacpp_problem(gguf_path: str, cache_dir) -> str | None:
    """None when this llama-cpp-python build decodes the file in a subprocess, else why not.

    A build compiled for CPU features the process may not use (a native build on an AMX CPU
    here) dies with a segmentation fault inside llama.cpp; probing in a child process turns that
    into a message. The verdict is cached per build and file."""
    import llama_cpp

    library = os.path.dirname(llama_cpp.__file__)
    stamp = [llama_cpp.__version__, gguf_path, os.path.getsize(gguf_path)]
    for name in sorted(os.listdir(os.path.join(library, "lib"))) if os.path.isdir(os.path.join(library, "lib")) else []:
        stamp.append([name, os.path.getmtime(os.path.join(library, "lib", name))])
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    verdict = cache_dir / f"llamacpp-probe-{key}.json"
    if verdict.is_file():
        return json.loads(verdict.read_text())["problem"]
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, gguf_path], capture_output=True, timeout=300)
        problem = None if done.returncode == 0 else (
            f"llama.cpp crashed decoding a probe (exit {done.returncode}"
            f"{', a segmentation fault' if done.returncode == -11 else ''})")
    except subprocess.TimeoutExpired:
        problem = "llama.cpp did not finish decoding a probe in 300 s"
    cache_dir.mkdir(parents=True, exist_ok=True)
    verdict.write_text(json.dumps({"problem": problem}))
    return problem
