"""A few greedy generations from one stage, for the report."""

import json
import time

from common import stage_model, start

start(snakemake)

import torch

from hybrid_llama.files import atomic_write
from hybrid_llama.runtime import device_name

cfg = snakemake.params.generations
model, tokenizer, meta, device = stage_model(snakemake, device=cfg["device"])
samples = []
for prompt in cfg["prompts"]:
    ids = tokenizer(prompt, return_tensors="pt").to(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **ids,
            max_new_tokens=cfg["max_new_tokens"],
            do_sample=False,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    new = out[0, ids["input_ids"].shape[1] :]
    samples.append(
        {
            "prompt": prompt,
            "completion": tokenizer.decode(new, skip_special_tokens=True),
            "new_tokens": int(new.numel()),
            "seconds": time.perf_counter() - t0,
        }
    )
result = {**meta, "device": cfg["device"], "torch_device": device, "device_name": device_name(device),
          "samples": samples}
atomic_write(snakemake.output[0], json.dumps(result, indent=1))
print(json.dumps(samples, indent=1))
