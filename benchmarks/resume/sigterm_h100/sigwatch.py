"""Run a script with a thread that watches SIGTERM's kernel-level disposition."""
import ctypes, os, runpy, signal, sys, threading, time, traceback

libc = ctypes.CDLL(None, use_errno=True)
class SigAction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]
def disposition():
    act = SigAction()
    libc.sigaction(signal.SIGTERM, None, ctypes.byref(act))
    return act.handler, act.flags
def watch():
    last = None
    main = threading.main_thread().ident
    while True:
        d = disposition()
        py = signal.getsignal(signal.SIGTERM)
        if (d, str(py)) != last:
            frame = sys._current_frames().get(main)
            where = "".join(traceback.format_stack(frame, limit=6)) if frame else "?"
            print(f"[sigwatch {time.strftime('%T')}.{int(time.time()*1000)%1000:03d}] SIGTERM kernel handler={d[0]} flags={d[1]:#x} python={py}\n{where}", file=sys.stderr, flush=True)
            last = (d, str(py))
        time.sleep(0.005)
import atexit
atexit.register(lambda: print(f"[sigwatch {time.strftime('%T')}] python exits normally", file=sys.stderr, flush=True))
threading.Thread(target=watch, daemon=True).start()
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
