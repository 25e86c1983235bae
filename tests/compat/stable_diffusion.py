# Copyright 2024 The HuggingFace Inc. team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# Accelerate 1.15's examples/inference/distributed/stable_diffusion.py (huggingface/accelerate@16cb6eb), ported to accel with the renames of
# docs/migrating-from-accelerate.md only. Replaced because they need the network (tests/compat/compat_offline.py):
#   - `DiffusionPipeline.from_pretrained(name)` -> `compat_offline.diffusion_pipeline(name)` (a tiny Stable Diffusion
#     pipeline built from configs, 32x32 images)

import compat_offline
import torch
from diffusers import DiffusionPipeline  # noqa: F401

from accel import Kernel  # Can also be Accelerator or AcceleratorState


pipe = compat_offline.diffusion_pipeline("stable-diffusion-v1-5/stable-diffusion-v1-5", torch_dtype=torch.float16)
distributed_state = Kernel()
pipe.to(distributed_state.device)

# Assume two processes
# On the first GPU, the prompts will be ["a dog", "a cat"],
# and on the second GPU it will be ["a chicken", "a chicken"].
# Make sure to drop the final sample, as it will be a duplicate of the previous one.
with distributed_state.split_between_processes(["a dog", "a cat", "a chicken"], apply_padding=True) as prompt:
    result = pipe(prompt).images
