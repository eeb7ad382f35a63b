"""One-off GPU check of the embedded engine in process (not a pytest test)."""
import json, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from engines.config import EngineConfig
from engines.embedded import EmbeddedEngine
from training.tiny_model import write_tiny_model
from safetensors.torch import load_file, save_file
import shutil

out = {}
d = write_tiny_model("/tmp/tiny")
v1 = Path("/tmp/tiny_v1"); v1.mkdir(exist_ok=True)
for f in d.iterdir():
    if f.name != "model.safetensors": shutil.copy(f, v1 / f.name)
save_file({k: v * 1.5 for k, v in load_file(str(d / "model.safetensors")).items()}, str(v1 / "model.safetensors"))
P = [[1, 5, 25, 6, 24], [1, 5, 6, 7, 8, 9, 10, 11, 12, 25, 13, 24], [1, 5], [1, 14, 15, 16, 22]]
sp = [{"temperature": 1.0, "max_new_tokens": 32, "sampling_seed": 100 + i, "stop_token_ids": []} for i in range(4)]
gpu = EmbeddedEngine(str(d), 0, EngineConfig(num_gpus_per_engine=1), 0)
cpu = EmbeddedEngine(str(d), 1, EngineConfig(), 0)
out["device"] = gpu.model_info()["device"]
g_batch = gpu.generate(P, sp)
g_alone = [gpu.generate([p], [s])[0] for p, s in zip(P, sp)]
c_batch = cpu.generate(P, sp)
ids = lambda rs: [r["output_ids"] for r in rs]
out["gpu_batch_eq_alone"] = ids(g_batch) == ids(g_alone)
out["gpu_eq_cpu"] = ids(g_batch) == ids(c_batch)
out["max_lp_diff_gpu_cpu"] = max(abs(a[0] - b[0]) for x, y in zip(g_batch, c_batch) for a, b in zip(x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]))
out["health"] = gpu.health_generate()
m0 = torch.cuda.memory_allocated()
out["release"] = gpu.release_memory_occupation()
m1 = torch.cuda.memory_allocated()
out["resume"] = gpu.resume_memory_occupation()
m2 = torch.cuda.memory_allocated()
out["mem_alloc_before_released_resumed"] = [m0, m1, m2]
out["update"] = gpu.update_weights_from_disk(str(v1), weight_version="1")
after = gpu.generate(P, sp)
out["version_after"] = after[0]["meta_info"]["weight_version"]
out["changed_after_update"] = ids(after) != ids(g_batch)
# Throughput: batch 64, 128 new tokens, tiny model on GPU.
bp = [P[i % 4] for i in range(64)]
bs = [dict(sp[0], sampling_seed=i, max_new_tokens=128) for i in range(64)]
gpu.generate(bp, bs); torch.cuda.synchronize(); t = time.perf_counter()
gpu.generate(bp, bs); torch.cuda.synchronize(); out["gpu_tiny_tok_s_b64"] = 64 * 128 / (time.perf_counter() - t)
print(json.dumps(out, indent=1))
Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(out, indent=1))
