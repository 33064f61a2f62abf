"""A small random diffusers pipeline (UNet2D + DDPM) on neuron, eager and compiled, vs CPU.

    python examples/diffusers_pipeline.py [--compile] [--steps 4] [--out image.png]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def pipeline():  # type: ignore[no-untyped-def]
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(32, 64), norm_num_groups=8,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=50))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--compile", action="store_true",
                   help="also run torch.compile(backend='neuron')")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", help="save the neuron image here (PNG)")
    args = p.parse_args()
    pipe = pipeline()

    def generate():  # type: ignore[no-untyped-def]
        return pipe(batch_size=1, num_inference_steps=args.steps, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    ref = generate()
    pipe.to("neuron")
    img = generate()
    print(f"eager on {pipe.device}: image {img.shape}, max |neuron - cpu| = "
          f"{np.abs(img - ref).max():.2e}")
    ok = np.abs(img - ref).max() < 1e-4
    if args.compile:
        pipe.unet = torch.compile(pipe.unet, backend="neuron")
        comp = generate()
        m = torch.neuron.get_dynamo_metrics()
        print(f"compiled (backend neuron, {m['num_compiles']} graph): max |neuron - cpu| = "
              f"{np.abs(comp - ref).max():.2e}")
        ok = ok and np.abs(comp - ref).max() < 1e-3
    if args.out:
        from PIL import Image

        Image.fromarray((img[0] * 255).round().astype("uint8")).save(args.out)
    if not ok:
        raise SystemExit("neuron and CPU images differ")


if __name__ == "__main__":
    main()
