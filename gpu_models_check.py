import inspect, time, torch, transformers, peft
from torch.nn.attention.varlen import varlen_attn
print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
print("varlen_attn", inspect.signature(varlen_attn))
from ligertune.models import build_model, patch_model, CausalLMLoss
from ligertune.recipe import ModelConfig
torch.manual_seed(0)
model = build_model(ModelConfig(config="llama-3.2-1b"), device="cuda", dtype="bfloat16")
print(patch_model(model).describe())
head = CausalLMLoss(model)
lengths = [700, 300, 1200, 96, 800, 1000]
T = sum(lengths)
ids = torch.randint(0, 128256, (1, T), device="cuda")
pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
tg = torch.roll(ids, -1, 1).clone(); 
cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
for e in cu[1:].tolist(): tg[0, e - 1] = -100
for _ in range(2):
    out = head(ids, pos, tg, cu_seqlens=cu); out.loss.backward()
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t = time.perf_counter()
for _ in range(5):
    out = head(ids, pos, tg, cu_seqlens=cu); out.loss.backward()
torch.cuda.synchronize()
print(f"fwd+bwd {T} tokens: {(time.perf_counter()-t)/5*1000:.1f} ms, peak {torch.cuda.max_memory_allocated()/2**30:.2f} GiB")
with torch.no_grad():
    packed = head(ids, pos, tg, cu_seqlens=cu, reduction="none").loss
    alone = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone.append(head(ids[:, s:e], pos[:, s:e], tg[:, s:e], reduction="none").loss)
    alone = torch.cat(alone)
    print("packed vs alone: rel", ((packed - alone).norm() / alone.norm()).item(), "sum", packed.sum().item(), alone.sum().item())
