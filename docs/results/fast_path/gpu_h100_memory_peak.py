# Peak-memory breakdown from a CUDA allocation history (torch.cuda.memory._dump_snapshot), used for
# docs/results/fast_path/gpu_h100.md: replays alloc / free_completed events, finds the peak of allocated
# bytes and groups the blocks live at the peak by their innermost project frames.
#     python docs/results/fast_path/gpu_h100_memory_peak.py SNAPSHOT.pickle[.gz] ...
import gzip, pickle, sys, collections
class _PlainData(pickle.Unpickler):
    """A snapshot holds only dicts, lists, strings and numbers: refuse any class or function it names."""
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"snapshot names {module}.{name}; refused (only plain data is read)")
def load(p):
    with (gzip.open(p) if p.endswith(".gz") else open(p, "rb")) as f:
        return _PlainData(f).load()
def where(frames):
    for fr in frames:
        fn = fr.get("filename", "")
        if "/work/main/" in fn and "step_breakdown" not in fn:
            return f"{fn.split('/work/main/')[1]}:{fr.get('line')} {fr.get('name')}"
    return (frames[0].get("filename","?").split("/")[-1] + ":" + str(frames[0].get("line")) + " " + frames[0].get("name","")) if frames else "?"
def stack(frames, k=4):
    out=[]
    for fr in frames:
        fn = fr.get("filename", "")
        if "/work/main/" in fn and "step_breakdown" not in fn:
            out.append(f"{fn.split('/work/main/')[1]}:{fr.get('line')} {fr.get('name')}")
        if len(out)>=k: break
    return " <- ".join(out)
for p in sys.argv[1:]:
    s = load(p)
    tr = [t for t in s["device_traces"] if t][0]
    live, cur, peak, peak_i = {}, 0, 0, -1
    for i, e in enumerate(tr):
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = e; cur += e["size"]
        elif a == "free_completed":
            if e["addr"] in live:
                cur -= live.pop(e["addr"])["size"]
        if cur > peak:
            peak, peak_i, snap = cur, i, dict(live)
    print(f"== {p}: {len(tr)} events, peak {peak/2**20:.1f} MiB at event {peak_i} ({tr[peak_i]['action']} of {tr[peak_i]['size']/2**20:.1f} MiB at {stack(tr[peak_i].get('frames', []), 6)})")
    groups = collections.Counter()
    for e in snap.values():
        groups[stack(e.get("frames", []), 3)] += e["size"]
    for k, v in groups.most_common(14):
        print(f"  {v/2**20:8.1f} MiB  {k}")
