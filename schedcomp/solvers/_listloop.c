/* The list scheduler's event loop (schedcomp/solvers/greedy.py, `list_schedule_steps`), compiled.
 *
 * The same algorithm, step for step, as the Python loop there, which stays the reference: every choice, every
 * tie-break and every floating-point operation is the same, so both give the same op log and the same steps
 * (tests/compiler/test_listloop.py compares them over every variant). The Python side prepares every table
 * (schedcomp/solvers/greedy_native.py) and splits the log per worker afterwards; this file only runs the loop,
 * one C iteration per op instead of one Python one (1.6 million at pp = 32, dp = 256), without the GIL.
 *
 * Two notes on equivalence with the Python loop:
 * - The Python loop's event queue is a heap of distinct times, each with its due workers run in id order; an op
 *   of zero time merges the workers it makes due now into that order. Both are one heap of (time, worker id)
 *   pairs here: the same order, pair for pair.
 * - Contraction of a * b + c into one fused multiply-add would round differently from Python: the build turns
 *   it off (-ffp-contract=off, setup.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double t;
    int64_t s;
} Entry;

typedef struct {
    Entry *a;
    Py_ssize_t n, cap;
} Heap;

typedef struct {
    int64_t *a;
    Py_ssize_t head, n, cap; /* live items are a[head:n] */
} Fifo;

static inline int entry_less(Entry x, Entry y) { return x.t < y.t || (x.t == y.t && x.s < y.s); }
static inline int entry_le(Entry x, Entry y) { return !entry_less(y, x); }

static int heap_push(Heap *h, double t, int64_t s) {
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 8;
        Entry *a = realloc(h->a, (size_t)cap * sizeof(Entry));
        if (a == NULL) return -1;
        h->a = a;
        h->cap = cap;
    }
    Entry e = {t, s};
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) >> 1;
        if (!entry_less(e, h->a[parent])) break;
        h->a[i] = h->a[parent];
        i = parent;
    }
    h->a[i] = e;
    return 0;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->a[0];
    Entry last = h->a[--h->n];
    Py_ssize_t n = h->n, i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && entry_less(h->a[c + 1], h->a[c])) c++;
        if (!entry_less(h->a[c], last)) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (n > 0) h->a[i] = last;
    return top;
}

static int fifo_push(Fifo *f, int64_t s) {
    if (f->head == f->n) f->head = f->n = 0;
    if (f->n == f->cap) {
        if (f->head > 0) { /* slide the live items down before growing */
            memmove(f->a, f->a + f->head, (size_t)(f->n - f->head) * sizeof(int64_t));
            f->n -= f->head;
            f->head = 0;
        }
        if (f->n == f->cap) {
            Py_ssize_t cap = f->cap ? 2 * f->cap : 8;
            int64_t *a = realloc(f->a, (size_t)cap * sizeof(int64_t));
            if (a == NULL) return -1;
            f->a = a;
            f->cap = cap;
        }
    }
    f->a[f->n++] = s;
    return 0;
}

/* A buffer of the tables object: attribute `name`, of item format `fmt` ('d' float64, 'q' int64) and, unless
 * `length` is negative, that many items. */
static int get_column(PyObject *tables, const char *name, char fmt, Py_ssize_t length, int writable,
                      Py_buffer *view) {
    PyObject *obj = PyObject_GetAttrString(tables, name);
    if (obj == NULL) return -1;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    int rc = PyObject_GetBuffer(obj, view, flags);
    Py_DECREF(obj);
    if (rc < 0) return -1;
    /* Native byte order only: "d", "q" or "l", or with "@" or "=" before it. */
    const char *f = view->format ? view->format : "B";
    if (f[0] == '@' || f[0] == '=') f++;
    int ok = view->itemsize == 8 && f[0] != 0 && f[1] == 0 && (fmt == 'd' ? f[0] == 'd' : (f[0] == 'q' || f[0] == 'l'));
    if (!ok || (length >= 0 && view->len != length * 8)) {
        PyErr_Format(PyExc_ValueError, "list loop table %s: expected %zd items of format %c, got %zd bytes of %s",
                     name, length, fmt, view->len, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static long get_int(PyObject *tables, const char *name, int *failed) {
    PyObject *obj = PyObject_GetAttrString(tables, name);
    if (obj == NULL) {
        *failed = 1;
        return 0;
    }
    long v = PyLong_AsLong(obj);
    Py_DECREF(obj);
    if (v == -1 && PyErr_Occurred()) *failed = 1;
    return v;
}

static double get_float(PyObject *tables, const char *name, int *failed) {
    PyObject *obj = PyObject_GetAttrString(tables, name);
    if (obj == NULL) {
        *failed = 1;
        return 0.0;
    }
    double v = PyFloat_AsDouble(obj);
    Py_DECREF(obj);
    if (v == -1.0 && PyErr_Occurred()) *failed = 1;
    return v;
}

enum {
    C_LIMITS, C_WINDOW_OPEN, C_ADMIT, C_DUR_ROW, C_CAP, C_LEFT_F, C_LIVE,  /* per worker (live: the ids) */
    C_FIRST, C_RESERVE, C_D_F, C_D_B, C_D_W, C_PLACE,                     /* per stage */
    C_UNIT, C_ROOM, C_HELD_PTR, C_HELD, C_PEERS_PTR, C_PEERS,             /* per place (CSR lists) */
    C_RUNNER, C_HOME, C_SIZE, C_STARTS, C_DUR, C_LOG,                     /* per slot; starts; op times; out */
    N_COLUMNS
};

typedef struct {
    /* sizes and switches */
    Py_ssize_t n_workers, pp, stages, nk, n_slots, n_rows;
    int split, eager, idle, use_pool, capped, fill, ahead, cut;
    double p2p, eps;
    /* columns */
    const double *limits, *window_open, *admit, *reserve, *d_f, *d_b, *d_w, *unit, *room, *size, *dur;
    const int64_t *dur_row, *cap, *live, *first, *place, *held_ptr, *held, *peers_ptr, *peers, *home, *starts;
    Py_ssize_t n_live, n_starts;
    int64_t *runner, *left_f, *log;
    Py_ssize_t log_cap;
    /* state */
    double *free_at, *wake, *infl, *mem, *reserved, *w_time, *f_end;
    int64_t *taken, *open_b;
    Heap *fq, *bq, *lq, *xq, *pool, events;
    Fifo *wq;
    int64_t *batches;
    Py_ssize_t n_batches, batches_cap, n_log;
    int oom;
} Loop;

static inline void wake_at(Loop *L, int64_t r, double ready) {
    double at = ready > L->free_at[r] ? ready : L->free_at[r];
    if (at < L->wake[r]) {
        L->wake[r] = at;
        if (heap_push(&L->events, at, r) < 0) L->oom = 1;
    }
}

static void deliver_f(Loop *L, int64_t slot, double ready) {
    int64_t r = L->runner[slot];
    if (r >= 0) {
        Heap *q = (L->fill && L->home[slot] != r) ? &L->xq[r] : L->first[slot % L->stages] ? &L->fq[r] : &L->lq[r];
        if (heap_push(q, ready, slot) < 0) L->oom = 1;
        wake_at(L, r, ready);
    } else { /* re-routed, on its stage's pool: every peer that may still take one is told */
        int64_t p = L->place[slot % L->stages];
        if (heap_push(&L->pool[p], ready, slot) < 0) L->oom = 1;
        for (int64_t i = L->peers_ptr[p]; i < L->peers_ptr[p + 1]; i++) {
            int64_t q = L->peers[i];
            if (!L->capped || L->taken[q] < L->cap[q]) wake_at(L, q, ready);
        }
    }
}

static void deliver_b(Loop *L, int64_t slot, double ready) {
    int64_t r = L->runner[slot];
    if (heap_push(&L->bq[r], ready, slot) < 0) L->oom = 1;
    wake_at(L, r, ready);
}

/* The loop; returns 0, or -1 out of memory. Comments name the Python loop's variables. */
static int run_loop(Loop *L) {
    const double inf = INFINITY, eps = L->eps;
    const Py_ssize_t stages = L->stages, nk = L->nk, pp = L->pp;
    const int64_t last_stage = stages - 1;
    for (Py_ssize_t i = 0; i < L->n_starts; i++) deliver_f(L, L->starts[i], 0.0);
    for (Py_ssize_t i = 0; i < L->n_live; i++) {
        int64_t wid = L->live[i];
        if (L->wake[wid] == inf) {
            L->wake[wid] = 0.0;
            if (heap_push(&L->events, 0.0, wid) < 0) return -1;
        }
    }
    double current = -1.0; /* the time whose workers run (none yet: times are >= 0) */
    while (L->events.n) {
        if (L->oom) return -1;
        Entry ev = heap_pop(&L->events);
        double t = ev.t;
        int64_t w = ev.s;
        if (t != current) { /* a new step of the clock: `batches` */
            current = t;
            if (L->n_batches == L->batches_cap) {
                Py_ssize_t cap = L->batches_cap ? 2 * L->batches_cap : 1024;
                int64_t *a = realloc(L->batches, (size_t)cap * sizeof(int64_t));
                if (a == NULL) return -1;
                L->batches = a;
                L->batches_cap = cap;
            }
            L->batches[L->n_batches++] = L->n_log;
        }
        if (L->wake[w] != t) continue; /* woken earlier since: a stale entry */
        const double *dw = L->dur + L->dur_row[w] * stages * nk;
        Heap *bqw = &L->bq[w];
        Fifo *wqw = &L->wq[w];
        int64_t slot = -1;
        int kind;
        if (bqw->n && bqw->a[0].t <= t) {
            slot = heap_pop(bqw).s;
            kind = 1;
        } else if (wqw->n > wqw->head && L->eager) {
            slot = wqw->a[wqw->head++];
            kind = 2;
        } else {
            kind = -1;
            int64_t s = w % pp;
            Heap *fqw = &L->fq[w], *lqw = &L->lq[w], *xqw = &L->xq[w], *pool_s = &L->pool[s];
            double held_now = L->mem[w] + L->reserved[w];
            int mem_ok = held_now + L->admit[w] <= L->limits[w];
            int f_ok = L->infl[w] < L->window_open[w] && (mem_ok || L->cut);
            int pool_ok = L->use_pool && pool_s->n && (!L->capped || L->taken[w] < L->cap[w]);
            const Entry *later = (lqw->n && lqw->a[0].t <= t) ? &lqw->a[0] : NULL;
            const Entry *own = (f_ok && fqw->n && fqw->a[0].t <= t) ? &fqw->a[0] : NULL;
            const Entry *other = (f_ok && pool_ok && pool_s->a[0].t <= t) ? &pool_s->a[0] : NULL;
            if (L->cut) {
                double lim = L->limits[w], u = L->unit[s];
                if (own && !(held_now + u * L->size[own->s] <= lim)) own = NULL;
                if (other && !(held_now + u * L->size[other->s] <= lim)) other = NULL;
                const Entry *piece = (f_ok && xqw->n && xqw->a[0].t <= t) ? &xqw->a[0] : NULL;
                if (piece && !(held_now + u * L->size[piece->s] <= lim)) piece = NULL;
                if (piece && L->ahead && fqw->n && fqw->a[0].t > t) {
                    int64_t ps = piece->s % stages;
                    double took = dw[ps * nk] + (ps == last_stage ? dw[ps * nk + 1] : 0.0);
                    if (!(t + took * L->size[piece->s] <= fqw->a[0].t + eps)) piece = NULL;
                }
                if (piece && !own && !other && !later) {
                    slot = heap_pop(xqw).s;
                    kind = 0;
                }
            }
            if (kind == 0) {
            } else if (later && (!own || entry_le(*later, *own)) && (!other || entry_le(*later, *other))) {
                slot = heap_pop(lqw).s;
                kind = 0;
            } else if (own && (!other || entry_le(*own, *other))) {
                slot = heap_pop(fqw).s;
                kind = 0;
            } else if (other) {
                slot = heap_pop(pool_s).s;
                /* the micro-batch's later chunks here follow it */
                int64_t of_microbatch = slot - slot % stages;
                for (int64_t i = L->held_ptr[s]; i < L->held_ptr[s + 1]; i++) L->runner[of_microbatch + L->held[i]] = w;
                L->taken[w] += L->held_ptr[s + 1] - L->held_ptr[s];
                kind = 0;
            } else {
                int has_w = wqw->n > wqw->head;
                int hold = has_w && L->ahead && L->split && L->left_f[w] == 0 && L->open_b[w] == 1 &&
                           L->w_time[w] + dw[s * nk + 2] <= L->room[s];
                if (has_w && !hold && (L->idle || !mem_ok || (L->ahead && L->left_f[w] == 0))) {
                    slot = wqw->a[wqw->head++];
                    kind = 2;
                } else {
                    double nxt = bqw->n ? bqw->a[0].t : inf;
                    if (lqw->n && lqw->a[0].t < nxt) nxt = lqw->a[0].t;
                    if (f_ok) {
                        if (fqw->n && fqw->a[0].t < nxt && (!L->cut || fqw->a[0].t > t)) nxt = fqw->a[0].t;
                        if (xqw->n && xqw->a[0].t < nxt && xqw->a[0].t > t) nxt = xqw->a[0].t;
                        if (pool_ok && pool_s->a[0].t < nxt && (!L->cut || pool_s->a[0].t > t)) nxt = pool_s->a[0].t;
                    }
                    int64_t w0 = has_w ? wqw->a[wqw->head] : 0;
                    if (has_w && !hold &&
                        (nxt == inf || t + dw[(w0 % stages) * nk + 2] * (L->cut ? L->size[w0] : 1.0) <= nxt + eps)) {
                        slot = wqw->a[wqw->head++];
                        kind = 2;
                    } else if (nxt < inf) {
                        L->wake[w] = nxt;
                        if (heap_push(&L->events, nxt, w) < 0) return -1;
                        continue;
                    } else {
                        L->wake[w] = inf;
                        continue; /* nothing known yet: a delivery will wake this worker */
                    }
                }
            }
        }
        int64_t st = slot % stages;
        double scale = L->cut ? L->size[slot] : 1.0;
        double end = t + dw[st * nk + kind] * scale;
        if (heap_push(&L->events, end, w) < 0) return -1;
        L->free_at[w] = end;
        L->wake[w] = end;
        if (L->n_log == L->log_cap) return -2; /* (the error is set once the GIL is held again) */
        L->log[L->n_log++] = slot * nk + kind;
        if (kind == 0) {
            if (L->ahead) {
                L->left_f[w] -= 1;
                L->open_b[w] += 1;
            }
            if (L->first[st]) {
                L->infl[w] += scale;
                if (L->reserve[st] != 0.0) L->reserved[w] += L->reserve[st] * scale;
            } else {
                L->reserved[w] -= L->d_f[st] * scale;
            }
            L->mem[w] += L->d_f[st] * scale;
            if (st == last_stage) {
                deliver_b(L, slot, end);
            } else {
                L->f_end[slot] = end;
                int64_t nxt_slot = slot + 1;
                int64_t r = L->runner[nxt_slot];
                deliver_f(L, nxt_slot, (L->p2p != 0.0 && r != w) ? end + L->p2p : end);
            }
        } else if (kind == 1) {
            if (L->first[st]) L->infl[w] -= scale;
            L->mem[w] += L->d_b[st] * scale;
            if (L->split) {
                if (fifo_push(wqw, slot) < 0) return -1;
                if (L->ahead) L->w_time[w] += dw[st * nk + 2] * scale;
            }
            if (L->ahead) L->open_b[w] -= 1;
            if (st > 0) {
                int64_t up = slot - 1;
                double ready = (L->p2p != 0.0 && L->runner[up] != w) ? end + L->p2p : end;
                deliver_b(L, up, L->f_end[up] > ready ? L->f_end[up] : ready);
            }
        } else {
            L->mem[w] += L->d_w[st] * scale;
            if (L->ahead) L->w_time[w] -= dw[st * nk + 2] * scale;
        }
    }
    return L->oom ? -1 : 0;
}

static void free_heaps(Heap *h, Py_ssize_t n) {
    if (h == NULL) return;
    for (Py_ssize_t i = 0; i < n; i++) free(h[i].a);
    free(h);
}

static PyObject *listloop_run(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *inputs, *tables; /* the sizes and switches (LoopInputs); the columns (LoopTables) */
    if (!PyArg_ParseTuple(args, "OO:run", &inputs, &tables)) return NULL;
    static const char *names[N_COLUMNS] = {
        "limits", "window_open", "admit", "dur_row", "cap", "left_f", "live",
        "first", "reserve", "d_f", "d_b", "d_w", "place",
        "unit", "room", "held_ptr", "held", "peers_ptr", "peers",
        "runner", "home", "size", "starts", "dur", "log",
    };
    static const char formats[N_COLUMNS] = {
        'd', 'd', 'd', 'q', 'q', 'q', 'q',
        'q', 'd', 'd', 'd', 'd', 'q',
        'd', 'd', 'q', 'q', 'q', 'q',
        'q', 'q', 'd', 'q', 'd', 'q',
    };
    Loop L;
    memset(&L, 0, sizeof L);
    int failed = 0;
    L.n_workers = get_int(inputs, "n_workers", &failed);
    L.pp = get_int(inputs, "pp", &failed);
    L.stages = get_int(inputs, "stages", &failed);
    L.nk = get_int(inputs, "nk", &failed);
    L.n_slots = get_int(inputs, "n_slots", &failed);
    L.split = (int)get_int(inputs, "split", &failed);
    L.eager = (int)get_int(inputs, "eager", &failed);
    L.idle = (int)get_int(inputs, "idle", &failed);
    L.use_pool = (int)get_int(inputs, "use_pool", &failed);
    L.capped = (int)get_int(inputs, "capped", &failed);
    L.fill = (int)get_int(inputs, "fill", &failed);
    L.ahead = (int)get_int(inputs, "ahead", &failed);
    L.cut = (int)get_int(inputs, "cut", &failed);
    L.p2p = get_float(inputs, "p2p", &failed);
    L.eps = get_float(tables, "eps", &failed);
    if (failed) return NULL;
    if (L.n_workers <= 0 || L.pp <= 0 || L.stages <= 0 || L.nk < 2 || L.nk > 3 || L.n_slots < 0) {
        PyErr_SetString(PyExc_ValueError, "list loop: bad sizes");
        return NULL;
    }
    Py_ssize_t W = L.n_workers, S = L.stages, P = L.pp, N = L.n_slots;
    /* Expected lengths (-1: checked below, or any). */
    Py_ssize_t lengths[N_COLUMNS] = {
        W, W, W, W, L.capped ? W : -1, W, -1,
        S, S, S, S, L.split ? S : -1, S,
        P, L.ahead ? P : -1, P + 1, -1, P + 1, -1,
        N, L.fill ? N : -1, L.cut ? N : -1, -1, -1, -1,
    };
    Py_buffer views[N_COLUMNS];
    int got = 0;
    PyObject *result = NULL;
    for (; got < N_COLUMNS; got++) {
        int writable = got == C_RUNNER || got == C_LEFT_F || got == C_LOG;
        if (get_column(tables, names[got], formats[got], lengths[got], writable, &views[got]) < 0) goto done;
    }
    L.limits = views[C_LIMITS].buf;
    L.window_open = views[C_WINDOW_OPEN].buf;
    L.admit = views[C_ADMIT].buf;
    L.dur_row = views[C_DUR_ROW].buf;
    L.cap = views[C_CAP].buf;
    L.left_f = views[C_LEFT_F].buf;
    L.live = views[C_LIVE].buf;
    L.n_live = views[C_LIVE].len / 8;
    L.first = views[C_FIRST].buf;
    L.reserve = views[C_RESERVE].buf;
    L.d_f = views[C_D_F].buf;
    L.d_b = views[C_D_B].buf;
    L.d_w = views[C_D_W].buf;
    L.place = views[C_PLACE].buf;
    L.unit = views[C_UNIT].buf;
    L.room = views[C_ROOM].buf;
    L.held_ptr = views[C_HELD_PTR].buf;
    L.held = views[C_HELD].buf;
    L.peers_ptr = views[C_PEERS_PTR].buf;
    L.peers = views[C_PEERS].buf;
    L.runner = views[C_RUNNER].buf;
    L.home = views[C_HOME].buf;
    L.size = views[C_SIZE].buf;
    L.starts = views[C_STARTS].buf;
    L.n_starts = views[C_STARTS].len / 8;
    L.dur = views[C_DUR].buf;
    L.n_rows = views[C_DUR].len / 8 / (S * L.nk);
    L.log = views[C_LOG].buf;
    L.log_cap = views[C_LOG].len / 8;
    /* Every index the loop follows, checked once here, so that a wrong table is an error rather than a crash. */
    {
        const char *bad = NULL;
        for (Py_ssize_t i = 0; i < L.n_live && !bad; i++) {
            int64_t w = L.live[i];
            if (w < 0 || w >= W || L.dur_row[w] < 0 || L.dur_row[w] >= L.n_rows) bad = "live/dur_row";
        }
        for (Py_ssize_t s = 0; s < S && !bad; s++)
            if (L.place[s] < 0 || L.place[s] >= P) bad = "place";
        for (Py_ssize_t p = 0; p < P && !bad; p++) {
            if (L.held_ptr[p] < 0 || L.held_ptr[p] > L.held_ptr[p + 1] || L.peers_ptr[p] < 0 ||
                L.peers_ptr[p] > L.peers_ptr[p + 1])
                bad = "held_ptr/peers_ptr";
        }
        if (!bad && (L.held_ptr[P] > views[C_HELD].len / 8 || L.peers_ptr[P] > views[C_PEERS].len / 8))
            bad = "held/peers";
        /* Each stage is held at its place, once: a pool slot's later chunks follow it there. */
        char *seen = bad ? NULL : calloc((size_t)S, 1);
        if (!bad && seen == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t p = 0; !bad && p < P; p++)
            for (int64_t i = L.held_ptr[p]; !bad && i < L.held_ptr[p + 1]; i++)
                if (L.held[i] < 0 || L.held[i] >= S || L.place[L.held[i]] != p || seen[L.held[i]]++) bad = "held";
        free(seen);
        if (!bad && (L.held_ptr[0] != 0 || L.held_ptr[P] != S)) bad = "held";
        if (!bad && P > S) bad = "pp";
        for (Py_ssize_t i = 0; !bad && i < L.peers_ptr[P]; i++)
            if (L.peers[i] < 0 || L.peers[i] >= W || L.dur_row[L.peers[i]] < 0) bad = "peers";
        for (Py_ssize_t i = 0; !bad && i < N; i++)
            if (L.runner[i] >= W || (L.runner[i] >= 0 && L.dur_row[L.runner[i]] < 0)) bad = "runner";
        for (Py_ssize_t i = 0; !bad && i < L.n_starts; i++)
            if (L.starts[i] < 0 || L.starts[i] >= N) bad = "starts";
        if (!bad && N % S) bad = "n_slots";
        if (bad) {
            PyErr_Format(PyExc_ValueError, "list loop: table %s out of range (a bug)", bad);
            goto done;
        }
    }
    L.free_at = calloc((size_t)W, sizeof(double));
    L.wake = malloc((size_t)W * sizeof(double));
    L.infl = calloc((size_t)W, sizeof(double));
    L.mem = calloc((size_t)W, sizeof(double));
    L.reserved = calloc((size_t)W, sizeof(double));
    L.w_time = calloc((size_t)W, sizeof(double));
    L.f_end = calloc((size_t)(N ? N : 1), sizeof(double));
    L.taken = calloc((size_t)W, sizeof(int64_t));
    L.open_b = calloc((size_t)W, sizeof(int64_t));
    L.fq = calloc((size_t)W, sizeof(Heap));
    L.bq = calloc((size_t)W, sizeof(Heap));
    L.lq = calloc((size_t)W, sizeof(Heap));
    L.xq = calloc((size_t)W, sizeof(Heap));
    L.pool = calloc((size_t)P, sizeof(Heap));
    L.wq = calloc((size_t)W, sizeof(Fifo));
    if (!L.free_at || !L.wake || !L.infl || !L.mem || !L.reserved || !L.w_time || !L.f_end || !L.taken ||
        !L.open_b || !L.fq || !L.bq || !L.lq || !L.xq || !L.pool || !L.wq) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < W; i++) L.wake[i] = INFINITY;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run_loop(&L);
    Py_END_ALLOW_THREADS
    if (rc == -1) {
        PyErr_NoMemory();
        goto done;
    }
    if (rc < 0) {
        PyErr_SetString(PyExc_RuntimeError, "list loop: more ops than the problem has (a bug)");
        goto done;
    }
    {
        PyObject *batches = PyBytes_FromStringAndSize((const char *)L.batches, L.n_batches * (Py_ssize_t)8);
        if (batches == NULL) goto done;
        result = Py_BuildValue("(nN)", L.n_log, batches);
    }
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    free(L.free_at);
    free(L.wake);
    free(L.infl);
    free(L.mem);
    free(L.reserved);
    free(L.w_time);
    free(L.f_end);
    free(L.taken);
    free(L.open_b);
    free_heaps(L.fq, W);
    free_heaps(L.bq, W);
    free_heaps(L.lq, W);
    free_heaps(L.xq, W);
    free_heaps(L.pool, P);
    if (L.wq) {
        for (Py_ssize_t i = 0; i < W; i++) free(L.wq[i].a);
        free(L.wq);
    }
    free(L.events.a);
    free(L.batches);
    return result;
}

static PyMethodDef methods[] = {
    {"run", listloop_run, METH_VARARGS,
     "run(inputs, tables) -> (ops logged, steps as int64 bytes): the list scheduler's loop over the sizes and "
     "switches of `inputs` (schedcomp.solvers.greedy_loop.LoopInputs) and the columns of `tables` "
     "(schedcomp.solvers.greedy_native.LoopTables); writes the op log and the runners of pool-routed slots."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_listloop", "The list scheduler's loop, compiled.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__listloop(void) { return PyModule_Create(&module); }
