import numpy as np, gpukv, traceback
import ml_dtypes
def tryit(label, f):
    try: r=f(); print(label, 'OK', r)
    except Exception as ex: print(label, 'EXC', type(ex).__name__, str(ex)[:300])
for kind in ['2bit','1bit','fp16','bf16','sign','ternary','powersgd']:
  opts={'type':kind}
  if kind=='powersgd': opts['rank']=1
  for dt in [np.float16, ml_dtypes.bfloat16, np.float64, np.int32, np.int64, np.uint8, np.bool_]:
    def f():
        kv=gpukv.create('device'); kv.set_gradient_compression(opts)
        shape=(4,4)
        kv.init('a', np.zeros(shape, dt))
        g=np.ones(shape, dt)
        kv.push('a', [g,g]); o=np.zeros(shape, dt); kv.pull('a', out=o)
        kv.push('a', [g,g]); kv.pull('a', out=o)
        return o.reshape(-1)[:4], o.dtype
    tryit(f'{kind} {np.dtype(dt).name}', f)
  for shape in [(), (1,), (0,), (1,1), (3,0)]:
    def f():
        kv=gpukv.create('device'); kv.set_gradient_compression(opts)
        kv.init('a', np.zeros(shape, np.float32))
        g=np.full(shape, 0.7, np.float32)
        kv.push('a', [g,g]); o=np.zeros(shape, np.float32); kv.pull('a', out=o)
        kv.push('a', [g,g]); kv.pull('a', out=o)
        return o
    tryit(f'{kind} shape {shape}', f)
