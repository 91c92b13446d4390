"""One bf16 row-block product (27B MLP gate_up, Q4, T = 4) for ncu: PYTHONPATH=. python bench/data/run29/ncu_rows.py"""
import torch

from bench.gpu_check import random_packed
from runtime.kernels.qgemm_rows_bf16 import qgemm_rows_bf16

w, _ = random_packed(34816, 5120, "Q4G64_F16S")
x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
y = torch.empty(4, 34816, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    qgemm_rows_bf16(x, w, y, 128, 1, 4, 3, False)
torch.cuda.synchronize()
