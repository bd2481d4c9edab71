"""Randomized stress driver for mpifusion's public API: hunts for silent wrong answers.

usage: mpiexec -n N python -m mpi4py tests/stress/stress_driver.py NTRIALS [BASE_SEED] [--only SEED] [-v]
(tests/stress/test_stress_buffers.py runs it: pytest --stress, or MPIFUSION_STRESS=1). Exit
status 1 on every rank when a trial failed.

Environment: STRESS_SEEDS=a,b,c (those seeds only), STRESS_WATCHDOG=s (dump every thread's
stack and exit after s seconds in one trial; default 150), STRESS_OUT=dir (where the per-rank
stack files mpifusion_stress_<tag>_<n>_<rank>.txt go; default the temp dir), STRESS_TAG,
STRESS_MUTATE=buf (self-test: one element off, every trial must FAIL). Opt-in, not in the
default run; the bugs it found have regression tests in the suite
(tests/comm/test_inline_collectives.py::test_fresh_engines_run_what_no_caller_waits_for).

Every rank draws the same trial from random.Random(seed); per-rank choices (call order,
feed modes, unused params) come from per-(seed, rank) generators that every rank can rebuild.
Every rank models the full grad buffer of EVERY rank of each buffer's communicator, in float64
holding exact values of the grad dtype, and compares its own buffer bit-exactly (or, where the
summation order makes the fp32/fp64 sum inexact, within a stated tolerance).
"""
import faulthandler
import os
import random
import sys
import tempfile
import time
import traceback

import numpy as np
from mpi4py import MPI

from mpifusion import CommOptions, FusedCommBuffer, FusionError, Param, fused_parameters
from mpifusion import dtypes as D
import mpifusion.comm as mcomm

W = MPI.COMM_WORLD
WR, WN = W.Get_rank(), W.Get_size()
VERBOSE = "-v" in sys.argv
MUTATE = os.environ.get("STRESS_MUTATE", "")
COVER = {}


def cover(key):
    COVER[key] = COVER.get(key, 0) + 1

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
DTYPES = {"float32": F32, "float64": F64, "float16": np.dtype(np.float16),
          "bfloat16": D.bfloat16}
HALF = (np.dtype(np.float16), D.bfloat16)
ITEM = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
SHAPES = [(1,), (2,), (3,), (7,), (13,), (17,), (31,), (61,), (127,), (257,), (1, 1), (3, 5),
          (7, 11), (13, 17), (2, 3, 5), (1, 97), (509,), (1021,), (64,), (128,), (256,),
          (33, 7), (4, 129), (2053,)]
RARE_SHAPES = [(0,), (4, 0)]


def h(*parts):
    """A stable 63-bit seed from a tuple."""
    x = 1469598103934665603
    for p in parts:
        for ch in repr(p).encode():
            x = ((x ^ ch) * 1099511628211) & ((1 << 64) - 1)
    return x >> 1


def gen_vals(shape, key, lo=-64, hi=64, den=8.0):
    rs = np.random.default_rng(h(*key))
    return rs.integers(lo, hi, size=shape).astype(np.float64) / den


# ----------------------------------------------------------------------------- arithmetic
def rnd(x, dt):
    """x (float64, exact in fp32 when dt is half) rounded to dt, back as float64."""
    x = np.asarray(x, np.float64)
    if dt in HALF:
        return x.astype(F32).astype(dt).astype(np.float64)
    return x.astype(dt).astype(np.float64)


def sc(x, dt, n):
    """What mpifusion/Paddle's scale_(1/n) gives on a buffer of dtype dt holding x."""
    x = np.asarray(x, np.float64)
    if dt == F64:
        return x * (1.0 / n)
    y = x.astype(F32) * np.float32(1.0 / n)
    if dt in HALF:
        return y.astype(dt).astype(np.float64)
    return y.astype(np.float64)


def frac_bits(v):
    """Per element: bits after the binary point needed to hold v exactly."""
    v = np.asarray(v, np.float64)
    m, e = np.frexp(v)
    M = np.abs(m * 2.0 ** 53).astype(np.int64)
    low = M & (-M)
    tz = np.where(M == 0, 0, np.log2(np.where(low == 0, 1, low)).astype(np.int64))
    fb = -(e.astype(np.int64) - 53 + tz)
    return np.where(M == 0, 0, np.maximum(fb, 0))


def ulp(x, dt):
    x = np.abs(np.asarray(x, np.float64))
    if dt in HALF:
        a = x.astype(dt)
        nxt = np.nextafter(a.astype(np.float32), np.float32(np.inf)).astype(dt)  # approx
        return np.maximum(np.abs(nxt.astype(np.float64) - a.astype(np.float64)), 2.0 ** -24)
    a = x.astype(dt)
    return np.abs(np.nextafter(a, np.asarray(np.inf, dt)).astype(np.float64) - a.astype(np.float64))


def reduce_model(locs, gdt, act, root, n, pre, post, own_scale, lo_hi=None):
    """Every group rank's buffer after the step (float64 exact values) and a tolerance array.

    locs: list over group ranks of the local (accumulated) buffers.
    pre: scale by 1/n before comm; post: 1/n applied to the received result
    (reduce-avg or scale_after_comm); own_scale: 1/n on regions that got no result
    (scale_after_comm and not reduce-avg).
    """
    red = F64 if gdt == F64 else F32
    L = [sc(l, gdt, n) if pre else l.copy() for l in locs]
    S = np.sum(L, axis=0) if L else None
    absS = np.sum(np.abs(L), axis=0)
    k = np.max([frac_bits(l) for l in L], axis=0)
    p = 53 if red == F64 else 24
    exact = absS * (2.0 ** k) < 2.0 ** p
    R = S.astype(red).astype(np.float64)
    u = 2.0 ** -(p)
    tol_sum = np.where(exact, 0.0, max(n - 1, 1) * u * absS * 1.0000001)
    if post:
        if gdt == F64:
            Rs = R * (1.0 / n)
        else:
            y = R.astype(F32) * np.float32(1.0 / n)
            Rs = (y.astype(gdt) if gdt in HALF else y).astype(np.float64)
        tol = tol_sum * (1.0 / n)
    else:
        Rs = rnd(R, gdt) if gdt in HALF else R
        tol = tol_sum
    tol = np.where(exact, 0.0, tol + ulp(Rs, gdt))
    outs, tols = [], []
    for r in range(n):
        if act == "all_reduce" or (act == "reduce" and r == root):
            outs.append(Rs.copy())
            tols.append(tol.copy())
            continue
        if pre:
            kept = L[r].copy()
        elif own_scale:
            kept = sc(locs[r], gdt, n)
        else:
            kept = locs[r].copy()
        t = np.zeros_like(kept)
        if act == "reduce_scatter":
            a, b = lo_hi[r]
            kept[a:b] = Rs[a:b]
            t[a:b] = tol[a:b]
        outs.append(kept)
        tols.append(t)
    return outs, tols


# ----------------------------------------------------------------------------- layouts
def aligned(numel, isz):
    rem = (numel * isz) % 256
    return numel + (0 if rem == 0 else (256 - rem) // isz)


def sharded(numel, isz, n):
    unit = (256 // isz) * n
    return -(-numel // unit) * unit


def my_layout(pspecs, act, n):
    """[(offset, numel)], total numel (Paddle's rules, counted in the param dtype)."""
    off, out = 0, []
    for name, shape, dt in pspecs:
        numel = int(np.prod(shape))
        isz = ITEM[dt]
        padded = sharded(numel, isz, n) if act == "reduce_scatter" else aligned(numel, isz)
        out.append((off, numel))
        off += padded
    return out, off


def paddle_groups(metas, limit):
    """eager_assign_group_by_size for one split: metas = [(dtype, nbytes)]."""
    open_groups, sizes, limit_idx, done = {}, {}, {}, []
    limits = [limit, limit]
    order = []
    for i, (dt, nb) in enumerate(metas):
        g = open_groups.setdefault(dt, [])
        if dt not in order:
            order.append(dt)
        g.append(i)
        sizes[dt] = sizes.get(dt, 0) + nb
        li = limit_idx.get(dt, 0)
        if sizes[dt] >= limits[min(li, len(limits) - 1)]:
            done.append(g)
            open_groups[dt] = []
            sizes[dt] = 0
            limit_idx[dt] = li + 1
    enum_order = ["bfloat16", "float16", "float32", "float64"]  # sorted below anyway
    for dt in enum_order:
        if open_groups.get(dt):
            done.append(open_groups[dt])
    done.sort(key=lambda g: g[0])
    return done


# ----------------------------------------------------------------------------- the trial
class Skip(Exception):
    pass


class BufModel:
    pass


def draw_options(rng):
    strategy = rng.choice(["thread", "nonblocking"])
    return CommOptions(strategy=strategy, window=rng.choice([1, 2, 8]),
                       segment_bytes=rng.choice([64, 4096, None, 0, 200]),
                       timeout=rng.choice([None, 60]),
                       order=rng.choice(["strict", "negotiated"]),
                       verify_order=rng.random() < 0.8,
                       allreduce=rng.choice(["auto", "auto", "mpi", "ring"]))


def draw_params(rng, tag, count=None, dtype=None, allow_zero=True):
    count = count or rng.randint(1, 6)
    dt = dtype or rng.choice(list(DTYPES))
    out = []
    for i in range(count):
        shape = rng.choice(SHAPES)
        if allow_zero and rng.random() < 0.03:
            shape = rng.choice(RARE_SHAPES)
        out.append((f"{tag}.p{i}", shape, dt))
    return out


class Trial:
    def __init__(self, seed):
        self.seed = seed
        self.rng = random.Random(seed)
        self.fail = []
        self.notes = []

    def err(self, msg):
        self.fail.append(msg)
        if len(self.fail) <= 6:
            sys.stderr.write(f"[seed {self.seed} world rank {WR}] MISMATCH {msg}\n")
            sys.stderr.flush()

    # -------------------------------------------------------------- comms
    def make_comms(self):
        rng = self.rng
        kinds = [rng.choice(["dup", "dup", "rev", "halves"]) for _ in range(rng.choice([1, 1, 2]))]
        self.comms = []
        for kind in kinds:
            if kind == "dup":
                c = W.Dup()
            elif kind == "rev":
                c = W.Split(0, WN - 1 - WR)
            else:
                c = W.Split(WR % 2, WR)
            members = c.allgather(WR)  # global ranks by group rank
            self.comms.append((kind, c, members, draw_options(rng)))

    # -------------------------------------------------------------- buffers
    def build(self):
        rng = self.rng
        self.mode = rng.choice(["direct", "direct", "fused"])
        self.bufs = []
        uid = 0
        if self.mode == "direct":
            for b in range(rng.randint(1, 4)):
                ci = rng.randrange(len(self.comms))
                m = BufModel()
                m.uid = uid
                uid += 1
                m.ci = ci
                m.pspecs = draw_params(rng, f"b{b}")
                m.act = rng.choice(["all_reduce", "reduce", "reduce_scatter"])
                m.acc = rng.randint(1, 3)
                m.sac = rng.random() < 0.5
                m.avg = rng.random() < 0.3
                m.release = rng.random() < 0.4
                m.fuse = (not m.release and m.act != "reduce_scatter" and rng.random() < 0.4)
                m.free = (m.act == "reduce_scatter" and m.release and rng.random() < 0.5)
                if m.free:
                    m.acc = 1
                dt = m.pspecs[0][2]
                umg_choice = rng.random()
                if dt in ("float16", "bfloat16"):
                    m.umg_arg = True if umg_choice < 0.5 else (False if umg_choice < 0.8 else None)
                else:
                    m.umg_arg = True if umg_choice < 0.15 else (False if umg_choice < 0.85 else None)
                m.init_main = m.umg_arg is None and rng.random() < 0.6
                m.umg = m.umg_arg if m.umg_arg is not None else m.init_main
                m.init_grads = rng.random() < 0.4
                m.dst_idx = rng.randrange(64)
                m.explicit = rng.random() < 0.2
                self.bufs.append(m)
        else:
            ci = rng.randrange(len(self.comms))
            self.f_ci = ci
            half = rng.choice(["float16", "bfloat16", "float64", None])
            specs = []
            for i in range(rng.randint(2, 12)):
                dt = "float32" if (half is None or rng.random() < 0.5) else half
                shape = rng.choice(SHAPES)
                specs.append((f"f.p{i}", shape, dt, rng.random() < 0.3, rng.random() < 0.7,
                              rng.random() < 0.5))  # is_distributed, need_clip, decay
            self.f_specs = specs
            self.f_act = rng.choice(["all_reduce", "reduce", "reduce_scatter"])
            self.f_acc = rng.randint(1, 3)
            self.f_sac = rng.random() < 0.5
            self.f_avg = rng.random() < 0.3
            self.f_umg = rng.random() < 0.5
            self.f_fuse = self.f_act != "reduce_scatter" and rng.random() < 0.6
            self.f_group = rng.choice([0, 1, 64, 256, 1024, 4096, 1 << 20])
            self.f_dst_idx = rng.randrange(64)
            self.f_hook = rng.random() < 0.6
            self.f_init_grads = rng.random() < 0.3
        keep = os.environ.get("STRESS_KEEP")
        if keep is not None and self.mode == "direct":
            self.bufs = [m for m in self.bufs if str(m.uid) in keep.split(",")]
        self.nsteps = rng.randint(2, 3)
        self.keep_mode = [rng.choice(["zero", "clear", "keep", "zero"]) for _ in range(3)]

    def instantiate(self):
        """Build the actual buffers (collective). Returns False to skip."""
        self.live = []
        if self.mode == "direct":
            for m in self.bufs:
                kind, comm, members, opts = self.comms[m.ci]
                n = len(members)
                m.n = n
                m.members = members
                m.grank = comm.Get_rank()
                m.dst_global = members[m.dst_idx % n] if m.act == "reduce" else -1
                m.root = members.index(m.dst_global) if m.act == "reduce" else None
                m.pdt = DTYPES[m.pspecs[0][2]]
                m.gdt = F32 if m.umg and m.pdt != F64 else m.pdt  # main grads >= param
                m.params = []
                m.init_data = {}
                m.init_grad = {}  # world rank -> {name: values}, only own rank kept here
                for i, (name, shape, dt) in enumerate(m.pspecs):
                    data = gen_vals(shape, (self.seed, "data", m.uid, i), den=4.0)
                    m.init_data[name] = data
                    kw = {}
                    if m.init_grads:
                        g0 = gen_vals(shape, (self.seed, "init", WR, m.uid, i))
                        kw["main_grad" if m.umg else "grad"] = g0.astype(m.gdt)
                    elif m.init_main and i == 0:
                        kw["main_grad"] = np.zeros(shape, m.gdt)
                    if m.umg_arg is None and m.init_main and i == 0 and "main_grad" not in kw:
                        kw["main_grad"] = np.zeros(shape, m.gdt)
                    if m.umg_arg is None and not m.init_main and "main_grad" in kw:
                        # use_main_grad=None resolves from params[0].main_grad: keep it False
                        kw.pop("main_grad")
                    m.params.append(Param(name, data.astype(DTYPES[dt]), **kw))
                m.had_init = {p.name: (p.main_grad if m.umg else p.grad) is not None
                              for p in m.params}
                m.buf = FusedCommBuffer(
                    m.uid, m.params, comm, acc_steps=m.acc, act=m.act, dst=m.dst_global,
                    use_main_grad=m.umg_arg, fuse_param=m.fuse, scale_after_comm=m.sac,
                    release_grads=m.release, use_reduce_avg=m.avg, free_grads_in_comm=m.free,
                    comm_options=opts)
                self.live.append(m)
        else:
            kind, comm, members, opts = self.comms[self.f_ci]
            n = len(members)
            dst_global = members[self.f_dst_idx % n] if self.f_act == "reduce" else -1
            params = []
            init_data = {}
            for i, (name, shape, dt, dist, clip, decay) in enumerate(self.f_specs):
                data = gen_vals(shape, (self.seed, "fdata", i), den=4.0)
                init_data[name] = data
                kw = {}
                if self.f_init_grads:
                    g0 = gen_vals(shape, (self.seed, "finit", WR, i))
                    kw["main_grad" if self.f_umg else "grad"] = g0.astype(
                        F32 if self.f_umg and dt != "float64" else DTYPES[dt])
                params.append(Param(name, data.astype(DTYPES[dt]), is_distributed=dist,
                                    need_clip=clip, **kw))
            decay_names = {s[0] for s in self.f_specs if s[5]}
            res = fused_parameters(
                params, use_main_grad=self.f_umg, fuse_param=self.f_fuse, comm_overlap=True,
                comm_group=comm, act=self.f_act, dst=dst_global, acc_step=self.f_acc,
                scale_after_comm=self.f_sac, apply_decay_param_fun=lambda nm: nm in decay_names,
                use_reduce_avg=self.f_avg, group_size=self.f_group, comm_options=opts)
            decay_fused, all_fused, buffers = res
            self.f_all_fused = all_fused
            self.f_decay_fused = decay_fused
            # expected grouping (Paddle's split order, then size groups)
            exp_groups = []
            for is_fp32 in (True, False):
                for dist in (True, False):
                    for clip in (True, False):
                        split = [s for s in self.f_specs if (s[2] == "float32") == is_fp32
                                 and s[3] == dist and s[4] == clip]
                        for dec in (True, False):
                            sub = [s for s in split if s[5] == dec]
                            if not sub:
                                continue
                            metas = [(s[2], int(np.prod(s[1])) * ITEM[s[2]]) for s in sub]
                            for g in paddle_groups(metas, self.f_group):
                                exp_groups.append(([sub[i][0] for i in g], dec))
            got = [[p.name for p in b.params] for b in buffers]
            if got != [g for g, _ in exp_groups]:
                self.err(f"fused_parameters grouping: got {got}, expected "
                         f"{[g for g, _ in exp_groups]}")
            if self.f_fuse:
                ndec = sum(1 for _, d in exp_groups if d)
                if len(all_fused) != len(buffers) or len(decay_fused) != ndec:
                    self.err(f"fused params: {len(all_fused)} all / {len(decay_fused)} decay "
                             f"for {len(buffers)} buffers, {ndec} decay groups")
            for bi, b in enumerate(buffers):
                m = BufModel()
                m.uid = bi
                m.ci = self.f_ci
                m.pspecs = [(p.name, p.shape, p.dtype) for p in b.params]
                m.act, m.acc, m.sac, m.avg = self.f_act, self.f_acc, self.f_sac, self.f_avg
                m.release, m.fuse, m.free = False, self.f_fuse, False
                m.umg = self.f_umg
                m.n, m.members, m.grank = n, members, comm.Get_rank()
                m.dst_global = dst_global
                m.root = members.index(dst_global) if self.f_act == "reduce" else None
                m.pdt = DTYPES[m.pspecs[0][2]]
                m.gdt = F32 if m.umg and m.pdt != F64 else m.pdt  # main grads >= param
                m.params = list(b.params)
                m.init_data = {p.name: init_data[p.name] for p in b.params}
                m.had_init = {p.name: False for p in b.params}
                m.init_grads = False
                m.explicit = False
                m.hook = self.f_hook
                m.buf = b
                self.live.append(m)
            self.bufs = self.live
        for m in self.live:
            self.check_layout(m)
            self.check_params_initial(m)
            m.state = {}  # group rank -> full buffer (float64) or None (not allocated)
            for r in range(m.n):
                m.state[r] = None if m.release else np.zeros(self.total(m))
            # release: a param's own grad held at construction is moved in at its first micro-step
            m.own = {}
            for r in range(m.n):
                wr = m.members[r]
                own = {}
                if m.release and m.init_grads:
                    for i, (name, shape, dt) in enumerate(m.pspecs):
                        own[name] = rnd(gen_vals(shape, (self.seed, "init", wr, m.uid, i)), m.gdt)
                m.own[r] = own
        return True

    def total(self, m):
        return my_layout(m.pspecs, m.act, m.n)[1]

    def check_layout(self, m):
        lay, total = my_layout(m.pspecs, m.act, m.n)
        m.slots = {name: (off, numel) for (name, _, _), (off, numel) in zip(m.pspecs, lay)}
        bl = m.buf.layout
        if bl.numel != total:
            self.err(f"buf {m.uid}: layout numel {bl.numel}, expected {total}")
        for name, (off, numel) in m.slots.items():
            s = bl[name]
            if (s.offset, s.numel) != (off, numel):
                self.err(f"buf {m.uid}: slot {name} {(s.offset, s.numel)} expected {(off, numel)}")
        if m.act == "reduce_scatter":
            sh = total // m.n
            m.shards = [(r * sh, (r + 1) * sh) for r in range(m.n)]
            if tuple(bl.shard_range(m.grank)) != m.shards[m.grank]:
                self.err(f"buf {m.uid}: shard_range {bl.shard_range(m.grank)}")
        else:
            m.shards = None
        if m.buf.grad_dtype != m.gdt:
            self.err(f"buf {m.uid}: grad dtype {m.buf.grad_dtype} expected {m.gdt}")

    def check_params_initial(self, m):
        for p in m.params:
            exp = m.init_data[p.name]
            got = np.asarray(p.data).astype(np.float64)
            if got.shape != exp.shape or not np.array_equal(got, exp):
                self.err(f"buf {m.uid}: param {p.name} data changed at fusion")

    # -------------------------------------------------------------- one step
    def per_rank_plan(self, m, wr, step):
        """(unused_after: {name: micro count before mark_unused or None}) for world rank wr."""
        prng = random.Random(h(self.seed, "plan", wr, step, m.uid))
        plan = {}
        for name, shape, dt in m.pspecs:
            if prng.random() < 0.12:
                plan[name] = prng.randrange(m.acc)  # mark_unused after this many add_grads
            else:
                plan[name] = None
        return plan

    def grad(self, m, wr, i, step, k):
        name, shape, dt = m.pspecs[i]
        return gen_vals(shape, (self.seed, "g", wr, m.uid, i, step, k))

    def model_local(self, m, r, step):
        wr = m.members[r]
        st = m.state[r]
        loc = np.zeros(self.total(m)) if st is None else st.copy()
        plan = self.per_rank_plan(m, wr, step)
        for i, (name, shape, dt) in enumerate(m.pspecs):
            off, numel = m.slots[name]
            sl = slice(off, off + numel)
            if m.release and st is None and name in m.own[r]:
                loc[sl] = m.own[r][name].reshape(-1)
            u = plan[name]
            steps = m.acc if u is None else u
            for k in range(steps):
                g = self.grad(m, wr, i, step, k).reshape(-1)
                loc[sl] = rnd(loc[sl] + g, m.gdt)
            if u == 0:
                loc[sl] = 0.0
        return loc

    def feed_events(self, step):
        """This rank's add_grad / mark_unused calls for every buffer."""
        rrng = random.Random(h(self.seed, "order", WR, step))
        events = []  # (m, i) per micro-step; ("u", m, i) for mark_unused
        plans = {}
        for m in self.live:
            plan = self.per_rank_plan(m, WR, step)
            plans[m.uid] = plan
            for i, (name, _, _) in enumerate(m.pspecs):
                u = plan[name]
                cnt = m.acc if u is None else u
                for _ in range(cnt):
                    events.append(("g", m, i))
                if u is not None:
                    events.append(("u", m, i))
        rrng.shuffle(events)
        opts_order = {m.uid: self.comms[m.ci][3].order for m in self.live}
        strict = [m for m in self.live if opts_order[m.uid] == "strict"]
        if strict:
            # strict: the order buffers complete in must be the same on every rank: take each
            # strict buffer's final event out and put it back in a shared order
            shared = random.Random(h(self.seed, "completion", step))
            pi = list(strict)
            shared.shuffle(pi)
            finals = {}
            for m in pi:
                idx = [j for j, e in enumerate(events) if e[1] is m]
                j = rrng.choice([jj for jj in idx if not any(
                    e2[1] is m and e2[2] == events[jj][2] for e2 in events[jj + 1:])])
                finals[m.uid] = events.pop(j)
            last = -1
            for m in pi:
                own = [j for j, e in enumerate(events) if e[1] is m]
                lo = max([last] + own) + 1
                pos = rrng.randint(lo, len(events))
                events.insert(pos, finals[m.uid])
                last = pos
        # micro index per param by occurrence (a mark_unused stays last for its param)
        counters = {}
        out = []
        for e in events:
            kind, m, i = e
            if kind == "g":
                k = counters.get((m.uid, i), 0)
                counters[(m.uid, i)] = k + 1
                out.append(("g", m, i, k))
            else:
                out.append(("u", m, i, None))
        # fix: a mark_unused must come after that param's add_grads
        fixed = []
        pending_u = {}
        seen = {}
        need = {}
        for m in self.live:
            for i, (name, _, _) in enumerate(m.pspecs):
                u = plans[m.uid][name]
                need[(m.uid, i)] = m.acc if u is None else u
        for e in out:
            kind, m, i, k = e
            if kind == "u" and seen.get((m.uid, i), 0) < need[(m.uid, i)]:
                pending_u[(m.uid, i)] = e
                continue
            fixed.append(e)
            if kind == "g":
                seen[(m.uid, i)] = seen.get((m.uid, i), 0) + 1
                if (m.uid, i) in pending_u and seen[(m.uid, i)] == need[(m.uid, i)]:
                    fixed.append(pending_u.pop((m.uid, i)))
        assert not pending_u
        return fixed, rrng

    def do_event(self, e, rrng, step, last_of_buf):
        kind, m, i, k = e
        p = m.params[i]
        buf = m.buf
        use_comm = not (m.explicit and last_of_buf)
        if kind == "u":
            buf.mark_unused(p, use_comm=use_comm)
        else:
            g = self.grad(m, WR, i, step, k)
            if m.umg:
                gd = rrng.choice([m.gdt, m.pdt])  # fp32 main grads of half params
            else:
                gd = m.pdt
            garr = g.astype(gd)
            mode = rrng.choice(["arg", "inplace", "alias"])
            attr = "main_grad" if m.umg else "grad"
            view = getattr(p, attr)
            hook = getattr(m, "hook", False)
            if mode == "arg":
                if hook and use_comm:
                    p.backward(garr)
                else:
                    buf.add_grad(p, use_comm=use_comm, grad=garr)
            elif mode == "inplace" or view is None:
                if view is None:
                    setattr(p, attr, garr.copy())
                else:
                    view += garr
                if hook and use_comm:
                    p.backward()
                else:
                    buf.add_grad(p, use_comm=use_comm)
            else:
                view += garr
                buf.add_grad(p, use_comm=use_comm, grad=view)
        if not use_comm:
            buf.comm_grads()

    def run_step(self, step):
        events, rrng = self.feed_events(step)
        remaining = {}
        for e in events:
            remaining[e[1].uid] = remaining.get(e[1].uid, 0) + 1
        for e in events:
            remaining[e[1].uid] -= 1
            self.do_event(e, rrng, step, remaining[e[1].uid] == 0)
            if rrng.random() < 0.05:
                time.sleep(rrng.random() * 0.002)
        order = list(self.live)
        rrng.shuffle(order)
        for m in order:
            m.buf.scale_grads()
        # model
        for m in self.live:
            locs = [self.model_local(m, r, step) for r in range(m.n)]
            pre = not m.sac and not m.avg
            post = m.avg or m.sac
            own_scale = m.sac and not m.avg
            outs, tols = reduce_model(locs, m.gdt, m.act, m.root, m.n, pre, post, own_scale,
                                      m.shards)
            self.check_buffer(m, outs[m.grank], tols[m.grank], step)
            for r in range(m.n):
                m.state[r] = outs[r]
            if m.free:
                for r in range(m.n):
                    m.state[r] = None  # next step allocates a full buffer again
        # RS param sync
        self.sync_step(step, rrng)
        # between steps
        if step + 1 < self.nsteps:
            self.between(step)

    def compare(self, what, got, exp, tol):
        got = np.asarray(got)
        g64 = got.astype(np.float64).reshape(-1)
        exp = exp.reshape(-1)
        tol = np.zeros_like(exp) if tol is None else tol.reshape(-1)
        if g64.shape != exp.shape:
            self.err(f"{what}: shape {g64.shape} expected {exp.shape}")
            return
        diff = np.abs(g64 - exp)
        bad = ~((diff <= tol) | (np.isnan(g64) & np.isnan(exp)))
        if bad.any():
            j = np.flatnonzero(bad)
            self.err(f"{what}: {bad.sum()}/{bad.size} elements differ; first at {j[0]}: got "
                     f"{g64[j[0]]!r} expected {exp[j[0]]!r} (tol {tol[j[0]]:g}); "
                     f"idx {j[:8].tolist()}")
        else:
            inexact = int((tol > 0).sum())
            if inexact:
                self.notes.append(inexact)

    def check_buffer(self, m, exp, tol, step):
        buf = m.buf
        where = f"step {step} buf {m.uid} ({m.act}, n={m.n}, grank={m.grank}, root={m.root}, " \
                f"{m.pdt.name}/{m.gdt.name}, acc={m.acc}, sac={m.sac}, avg={m.avg}, " \
                f"release={m.release}, free={m.free}, fuse={m.fuse})"
        gs = buf.grad_storage
        cover((m.act, m.pdt.name, m.gdt.name, "sac" if m.sac else "pre", "avg" if m.avg else "",
               "rel" if m.release else "", "free" if m.free else "", "fuse" if m.fuse else ""))
        cover(("strategy", self.comms[m.ci][3].strategy, self.comms[m.ci][3].order))
        if MUTATE == "buf" and gs is not None and gs.size and m.grank == 0 and step == 1:
            gs.reshape(-1)[gs.size // 2] += gs.dtype.type(1)
        if gs is not None and gs.size:
            cover("compared_buffers")
        if m.free:
            a, b = m.shards[m.grank]
            if gs is None or gs.size != b - a:
                self.err(f"{where}: free_grads_in_comm grad_storage size "
                         f"{None if gs is None else gs.size}, expected {b - a}")
                return
            self.compare(f"{where} shard", gs, exp[a:b], tol[a:b])
            return
        if gs is None:
            self.err(f"{where}: grad_storage is None")
            return
        if gs.dtype != m.gdt:
            self.err(f"{where}: grad_storage dtype {gs.dtype}")
        self.compare(f"{where} grad_storage", gs, exp, tol)
        attr = "main_grad" if m.umg else "grad"
        for p in m.params:
            off, numel = m.slots[p.name]
            v = getattr(p, attr)
            if v is None:
                self.err(f"{where}: {p.name}.{attr} is None after scale_grads")
                continue
            if np.shares_memory(v, gs) is False and numel:
                self.err(f"{where}: {p.name}.{attr} is not a view of grad_storage")
            self.compare(f"{where} {p.name}.{attr}", v, exp[off:off + numel], tol[off:off + numel])
        if m.fuse:
            ps = buf.param_storage
            pexp = np.zeros(self.total(m))
            for p in m.params:
                off, numel = m.slots[p.name]
                pexp[off:off + numel] = m.init_data[p.name].reshape(-1)
                self.compare(f"{where} {p.name}.data", p.data, m.init_data[p.name], None)
            self.compare(f"{where} param_storage", ps, pexp, None)

    def sync_step(self, step, rrng):
        rs = [m for m in self.live if m.act == "reduce_scatter"]
        if not rs:
            return
        shared = random.Random(h(self.seed, "sync", step))
        neg_pos = [j for j, m in enumerate(rs) if self.comms[m.ci][3].order == "negotiated"]
        neg = [rs[j] for j in neg_pos]
        rrng.shuffle(neg)
        for j, m in zip(neg_pos, neg):
            rs[j] = m
        tasks = []
        for m in rs:
            buf = m.buf
            total = self.total(m)
            variant = shared.choice(["write", "write", "reset"])
            if variant == "reset":
                buf.clear_param_storage()
                if buf.status != FusedCommBuffer.Status.SHARDED:
                    self.err(f"buf {m.uid}: status after clear {buf.status}")
                buf.reset_param_storage()
            full = np.zeros(total)
            for r in range(m.n):
                a, b = m.shards[r]
                full[a:b] = gen_vals(b - a, (self.seed, "shard", m.members[r], m.uid, step),
                                     den=4.0)
            m.full_expected = full
            a, b = m.shards[m.grank]
            buf.param_storage[a:b] = full[a:b].astype(m.pdt)
            negotiated = self.comms[m.ci][3].order == "negotiated"
            sync = (not negotiated) and shared.random() < 0.5
            if sync:
                buf.sync_params(sync=True)
            else:
                d = {}
                t = buf.sync_params(sync=False, param2task=d)
                if t is not None and m.n > 1:
                    if set(d) != {p.name for p in m.params} or any(v is not t for v in d.values()):
                        self.err(f"buf {m.uid}: param2task {sorted(d)}")
                tasks.append((m, t))
        for m, t in tasks:
            if t is not None:
                t.wait()
        for m in rs:
            where = f"step {step} buf {m.uid} sync_params (n={m.n})"
            ps = m.buf.param_storage
            self.compare(f"{where} param_storage", ps, m.full_expected, None)
            for p in m.params:
                off, numel = m.slots[p.name]
                self.compare(f"{where} {p.name}.data", p.data, m.full_expected[off:off + numel],
                             None)
            if m.n > 1 and m.buf.status != FusedCommBuffer.Status.READY:
                self.err(f"{where}: status {m.buf.status}")
            for p in m.params:
                m.init_data[p.name] = m.full_expected[m.slots[p.name][0]:
                                                      m.slots[p.name][0] + m.slots[p.name][1]
                                                      ].reshape(p.shape)

    def between(self, step):
        mode = self.keep_mode[step]
        for m in self.live:
            pw2 = (m.n & (m.n - 1)) == 0
            md = mode
            if md == "keep" and (not pw2 or m.free):
                md = "zero"
            if md == "clear" and not m.release:
                md = "zero"
            if m.free:
                md = "clear" if mode == "clear" else "none"
            if md == "zero":
                m.buf.grad_storage[...] = 0
                for r in range(m.n):
                    if m.state[r] is not None:
                        m.state[r] = np.zeros_like(m.state[r])
            elif md == "clear":
                m.buf.clear_grad_storage()
                for r in range(m.n):
                    m.state[r] = None
                attr = "main_grad" if m.umg else "grad"
                for p in m.params:
                    if getattr(p, attr) is not None:
                        self.err(f"buf {m.uid}: {p.name}.{attr} kept after clear_grad_storage")
            # keep / none: nothing
            for r in range(m.n):
                m.own[r] = {}

    def close(self):
        for m in getattr(self, "live", []):
            try:
                m.buf.close()
            except Exception as exc:  # noqa
                self.err(f"close: {exc!r}")
        for kind, c, _, _ in getattr(self, "comms", []):
            mcomm.release(c)
            c.Free()


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    ntrials = int(args[0]) if args else 20
    base = int(args[1]) if len(args) > 1 else 1000
    only = None
    if "--only" in sys.argv:
        only = int(sys.argv[sys.argv.index("--only") + 1])
    seeds = [only] if only is not None else [base + t for t in range(ntrials)]
    if os.environ.get("STRESS_SEEDS"):
        seeds = [int(x) for x in os.environ["STRESS_SEEDS"].split(",")]
    nfail = nskip = nok = ninexact = 0
    t0 = time.time()
    tag = os.environ.get("STRESS_TAG", "run")
    hangf = open(os.path.join(os.environ.get("STRESS_OUT", tempfile.gettempdir()),
                              f"mpifusion_stress_{tag}_{WN}_{WR}.txt"), "w")
    for seed in seeds:
        hangf.write(f"--- seed {seed}\n")
        hangf.flush()
        faulthandler.dump_traceback_later(float(os.environ.get("STRESS_WATCHDOG", 150)), exit=True, file=hangf)
        tr = Trial(seed)
        status = "ok"
        try:
            tr.make_comms()
            tr.build()
            try:
                tr.instantiate()
            except FusionError as exc:
                status = "skip"
                if WR == 0 and VERBOSE:
                    print(f"seed {seed}: skip: {type(exc).__name__}: {exc}", flush=True)
                tr.notes_skip = f"{type(exc).__name__}: {str(exc)[:160]}"
            if status == "ok" and only is not None and WR == 0:
                for kind, c, mem, o in tr.comms:
                    print("comm", kind, mem, o, flush=True)
                for m in tr.live:
                    print("buf", m.uid, "comm", m.ci, m.act, "n", m.n, "root", m.root,
                          m.pdt.name, m.gdt.name, "acc", m.acc, "sac", m.sac, "avg", m.avg,
                          "rel", m.release, "free", m.free, "fuse", m.fuse, "explicit",
                          m.explicit, "numel", tr.total(m), m.pspecs, flush=True)
                print("steps", tr.nsteps, tr.keep_mode, flush=True)
            if status == "ok":
                for step in range(tr.nsteps):
                    tr.run_step(step)
        except Exception:
            faulthandler.dump_traceback(file=hangf, all_threads=True)
            hangf.flush()
            tr.err("exception: " + traceback.format_exc())
        finally:
            if status == "ok" or True:
                try:
                    tr.close()
                except Exception:
                    tr.err("close exception: " + traceback.format_exc())
        faulthandler.cancel_dump_traceback_later()
        bad = W.allreduce(1 if tr.fail else 0)
        skipped = W.allreduce(1 if status == "skip" else 0)
        if bad:
            nfail += 1
            if WR == 0:
                print(f"seed {seed}: FAIL on {bad} rank(s)", flush=True)
        elif skipped:
            nskip += 1
            if WR == 0:
                print(f"seed {seed}: skipped ({getattr(tr, 'notes_skip', 'other rank')})",
                      flush=True)
        else:
            nok += 1
            ninexact += 1 if tr.notes else 0
            if WR == 0 and VERBOSE:
                print(f"seed {seed}: ok ({tr.mode})", flush=True)
    allc = W.gather(COVER)
    if WR == 0 and VERBOSE:
        tot = {}
        for c in allc:
            for k, v in c.items():
                tot[k] = tot.get(k, 0) + v
        for k in sorted(tot, key=str):
            print("cover", k, tot[k])
    if WR == 0:
        print(f"DONE {WN} ranks {MPI.Get_library_version().splitlines()[0].split(',')[0].strip()}: "
              f"{nok} ok ({ninexact} with some inexact-tolerance elements), {nskip} skipped, "
              f"{nfail} FAILED, {time.time() - t0:.1f} s", flush=True)
    sys.exit(1 if nfail else 0)


if __name__ == "__main__":
    main()
