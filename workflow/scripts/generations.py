"""A few greedy generations from one stage, for the report."""

import json
import time

from hl_script import load_stage_model, start

start(snakemake)

import torch

cfg = snakemake.params.generations
model, tokenizer, meta, device = load_stage_model(snakemake, device=cfg["device"])
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
device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
result = {**meta, "device": cfg["device"], "torch_device": device, "device_name": device_name, "samples": samples}
with open(snakemake.output[0], "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(samples, indent=1))
