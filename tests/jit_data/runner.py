"""Fresh-process driver for the JIT tests: registers a test backend, calls ``cam_jit.jit.load``
and prints one JSON line describing what happened.

usage: runner.py SPEC_JSON [--barrier DIR N] [--die-at-publish]

SPEC_JSON: {"backend", "name", "root", "sources": [names], "headers": [names], "cflags": [...]}.
An audit hook records every process-spawning event per phase (import torch, import cam_jit,
load). ``--die-at-publish`` SIGKILLs this process at the audit event of the publishing
``os.rename`` (a complete build in a temp dir, not yet renamed), so the product code needs no
test hook. ``--barrier`` waits until N runners reached the load, to start cold builds together.
"""
import json
import os
import signal
import sys
import time

SPAWN_EVENTS = {"subprocess.Popen", "os.posix_spawn", "os.exec", "os.system", "os.fork",
                "os.forkpty", "os.spawn", "pty.spawn"}
phase = "import_torch"
events = []
die_at_publish = "--die-at-publish" in sys.argv


def audit(event, args):
    if event in SPAWN_EVENTS:
        events.append([phase, event, repr(args)[:300]])
    elif die_at_publish and event == "os.rename":
        src, dst = os.path.basename(str(args[0])), os.path.basename(str(args[1]))
        if src.startswith(".tmp-") and not dst.startswith(".tmp-"):
            os.kill(os.getpid(), signal.SIGKILL)


sys.addaudithook(audit)
import torch  # noqa: E402

phase = "import_cam_jit"
from cam_jit import jit  # noqa: E402
from pathlib import Path  # noqa: E402

phase = "setup"
raw = json.loads(sys.argv[1])
root = Path(raw["root"])
spec = jit.BuildSpec(backend=raw["backend"], name=raw["name"], root=root,
                     sources=tuple(root / s for s in raw["sources"]),
                     headers=tuple(root / h for h in raw.get("headers", ())),
                     cflags=tuple(raw.get("cflags", ())))
jit.register_backend(raw["backend"], lambda: spec)
if "--barrier" in sys.argv:
    i = sys.argv.index("--barrier")
    barrier, count = Path(sys.argv[i + 1]), int(sys.argv[i + 2])
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(barrier.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.01)

phase = "load"
try:
    loaded = jit.load(raw["backend"])
except jit.JitError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "events": events}))
    sys.exit(3)
phase = "check"
if "torch_op.cpp" in raw["sources"]:
    check = torch.ops._cam_jit_test.answer(1)
else:
    import ctypes

    lib = ctypes.CDLL(str(loaded.library))
    check = getattr(lib, "cam_jit_" + Path(raw["sources"][0]).stem)()
print(json.dumps({
    "built": loaded.built, "library": str(loaded.library), "entry": str(loaded.entry),
    "check": check, "events": events,
    "modules": sorted(m for m in ("filelock", "torch.utils.cpp_extension") if m in sys.modules),
}))
