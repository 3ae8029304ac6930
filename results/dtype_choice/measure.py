"""Forward seconds of the real target (Qwen2.5-Coder-1.5B) in bfloat16 and float32 on this CPU: 1 new token (decode)
and 128 (a prefill chunk), after a 32-token context; 2 threads, median of 2."""
import json
import torch
torch.set_num_threads(2)
from evospec.loading import cpu_description, load_qwen3_folder, named_pair_folders
from evospec.model.qwen3 import forward_seconds
folder = named_pair_folders("qwen2.5-coder")["target"]
out = {"cpu": cpu_description(), "threads": 2, "model": str(folder.name)}
for dtype in ("float32", "bfloat16"):
    model = load_qwen3_folder(folder, dtype, "cpu")
    out[dtype] = forward_seconds(model, sizes=(1, 128), context=32, repeats=2)
    del model
print(json.dumps(out, indent=1))
