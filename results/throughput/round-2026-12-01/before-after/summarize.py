"""The paired before/after ratios of run.sh's launches (run from the folder holding old-N.json, new-N.json)."""
import json
import statistics as st


def get(side: str, i: int) -> dict[str, float]:
    runs = json.load(open(f"{side}-{i}.json"))["runs"]
    return {name: launches[-1]["samples_per_s"] for name, launches in runs.items()}  # the kept launch


rows = []
for i in range(1, 6):
    o, n = get("old", i), get("new", i)
    rows.append((n["mpisgd k=2"] / o["mpisgd k=2"], n["mpisgd k=2 replicated"] / o["mpisgd k=2"],
                 n["mpisgd k=1"] / o["mpisgd k=1"], o["mpisgd k=2"] / (2 * o["mpisgd k=1"]),
                 n["mpisgd k=2"] / (2 * n["mpisgd k=1"]), n["mpisgd k=2 replicated"] / (2 * n["mpisgd k=1"])))
names = ["new default k=2 / old k=2", "new replicated k=2 / old k=2", "new k=1 / old k=1",
         "old efficiency k=2", "new efficiency k=2 (default)", "new efficiency k=2 replicated"]
print("before (249c0fa, the round's start) and after (main), alternated 5 times, one launch of each per alternation;")
print("MLP 784-1024-1024-10, b=128, one BLAS thread per rank, MPISGD_PLAN_FILE=off")
for j, name in enumerate(names):
    v = [r[j] for r in rows]
    spread = f"median {st.median(v):.3f} (range {min(v):.3f}-{max(v):.3f})"
    print(f"  {name:32s} " + " ".join(f"{x:.3f}" for x in v) + "  " + spread)
