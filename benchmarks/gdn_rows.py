"""The K1 rows of bench_gdn.py's JSON ($OUT/bench_gdn.json) as one line each: ours and fla (eager, graph), the ratio,
and each K1 variant against fla. `python benchmarks/gdn_rows.py` after bench_gdn.py."""
import json, os, sys
p = os.path.join(os.environ.get("OUT", "."), "bench_gdn.json")
if not os.path.exists(p):
    sys.exit(f"no {p}")
R = json.load(open(p))
print(R["meta"])
for r in R["rows"]:
    if r.get("kernel") == "K1 chunk prefill":
        print(f"K1 {r['shape']:6} {r['dtype']:8} ours eager {r['ours_us']:.0f} graph {r['ours_graph_us']:.0f} | fla eager "
              f"{r.get('peer_us', 0):.0f} graph {r.get('peer_graph_us', 0):.0f} | ratio best {r.get('ratio_best', 0):.3f} "
              f"graph {r.get('ratio_graph', 0):.3f} | diff {r.get('peer_rel_diff', 0):.2e}")
    elif r.get("kernel") == "K1 variant":
        print(f"V  {r['shape']:6} {r['dtype']:8} {r['variant']:14} {r['us']:.0f} us fla/ours {r.get('ratio_peer_over_ours') or 0:.3f} "
              f"rel {r.get('rel_diff_to_default', 0):.1e} stages {r.get('stages_us')}")
for e in R.get("errors", []):
    print("ERROR", e["section"], e["error"][:300])
