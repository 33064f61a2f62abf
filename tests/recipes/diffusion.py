"""Recipe: a diffusers pipeline on neuron (DDPM with a tiny random UNet, latents drawn on CPU).

    python diffusion.py --device neuron --out image.json
"""

import argparse
import json

import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

p = argparse.ArgumentParser()
p.add_argument("--device", default="neuron")
p.add_argument("--out", required=True)
a = p.parse_args()

torch.manual_seed(0)
unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                   block_out_channels=(32, 64), norm_num_groups=8,
                   down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                   up_block_types=("AttnUpBlock2D", "UpBlock2D"))
pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=50)).to(a.device)
image = pipe(batch_size=1, num_inference_steps=3, output_type="np",
             generator=torch.Generator().manual_seed(0)).images
with open(a.out, "w") as f:
    json.dump({"image": image.reshape(-1).tolist()}, f)
