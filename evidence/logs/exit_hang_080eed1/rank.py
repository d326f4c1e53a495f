"""One rank of workbench.backend with exit instrumentation (DBG_MODE=plain|fix)."""
import atexit, os, sys, time, faulthandler, signal
t0 = time.time()
def say(m): print(f"[dbg r{os.environ.get('RANK')}] {time.time()-t0:7.2f}s {m}", file=sys.stderr, flush=True)
from workbench.backend import distributed, train
orig = distributed.destroy
def destroy():
    if os.environ.get("DBG_MODE") == "fix":
        import torch
        torch.cuda.synchronize(); say("synced")
        try:
            from torch._inductor import cudagraph_trees
            cudagraph_trees.reset_cudagraph_trees(); say("cudagraph trees reset")
        except Exception as e: say(f"reset failed {e!r}")
    say("destroy: start"); orig(); say("destroy: done")
distributed.destroy = destroy
atexit.register(lambda: say("atexit"))
code = train.main()
say(f"main returned {code}")
if os.environ.get("DBG_MODE") == "exit":
    sys.stdout.flush(); sys.stderr.flush(); os._exit(code)
sys.exit(code)
