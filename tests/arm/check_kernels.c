/* Runs every exported kernel of kernels.c, built for this machine's instruction set, on the cases that
 * tests/arm/cases.py wrote, and compares each output with the one stored there byte for byte (the portable
 * build's, which every x86 variant equals). Built with the kernels in one translation unit:
 *
 *     CC -O2 -ffp-contract=off -std=c11 [variant flags] [-fopenmp] tests/arm/check_kernels.c -o check -lm
 *     ./check cases.bin      (on Arm: qemu-aarch64 -L /usr/aarch64-linux-gnu ./check cases.bin)
 *
 * Prints one line per case and "N passed, N failed"; exits 1 when a case failed, 2 on a malformed file. */
#include "../../hsd_opt/engine/kernels.c"

#include <stdio.h>

static FILE *in;
static int failed, passed;

typedef struct {
    void *p;
    size_t n;
} arr_t;

static void die(const char *what) {
    fprintf(stderr, "check_kernels: %s\n", what);
    exit(2);
}

/* The next array, which must be named `name` (its bytes kept until the end: a few MB in all). */
static arr_t next(const char *name) {
    uint32_t len;
    char tag[64];
    uint64_t n;
    if (fread(&len, 4, 1, in) != 1 || len >= sizeof tag || fread(tag, 1, len, in) != len) die("truncated file");
    tag[len] = 0;
    if (strcmp(tag, name)) {
        fprintf(stderr, "check_kernels: expected array '%s', found '%s'\n", name, tag);
        exit(2);
    }
    if (fread(&n, 8, 1, in) != 1) die("truncated file");
    arr_t a = {n ? malloc(n) : NULL, (size_t)n};
    if (n && fread(a.p, 1, n, in) != n) die("truncated file");
    return a;
}

static void check(const char *what, const void *got, const arr_t *want, size_t bytes) {
    const int ok = want->n == bytes && memcmp(got, want->p, bytes) == 0;
    printf("%s %s\n", ok ? "ok    " : "FAILED", what);
    ok ? passed++ : failed++;
}

static hsd_mat read_mat(void) {
    arr_t h = next("mat");
    const int32_t *v = h.p;
    hsd_mat A = {v[0], v[1], v[2], 0, next("w").p, next("scale").p, next("zero").p, NULL};
    A.bias = next("bias").p;
    return A;
}

static void linear_case(int nt) {
    hsd_mat A = read_mat();
    arr_t pos = next("positions"), x = next("x");
    float *work = malloc(sizeof(float) * (size_t)nt * HSD_SCRATCH_ROWS * A.cols);
    for (size_t i = 0; i < pos.n / 4; i++) {
        const int m = ((int32_t *)pos.p)[i];
        arr_t want = next("y");
        float *y = calloc((size_t)m * A.rows, sizeof(float));
        char what[96];
        snprintf(what, sizeof what, "hsd_linear type %d [%d x %d] at %d positions", A.type, A.rows, A.cols, m);
        if (hsd_linear(&A, x.p, m, y, work, nt) != 0) die("hsd_linear refused its arguments");
        check(what, y, &want, sizeof(float) * (size_t)m * A.rows);
        free(y);
    }
    free(work);
}

static void layers_case(int nt) {
    const int32_t *mv = next("model").p;
    const float *eps = next("eps").p;
    const int L = mv[5];
    hsd_layer *layers = calloc(L, sizeof(hsd_layer));
    for (int l = 0; l < L; l++) {
        hsd_mat *m[7] = {&layers[l].q, &layers[l].k, &layers[l].v, &layers[l].o, &layers[l].gate, &layers[l].up,
                         &layers[l].down};
        for (int i = 0; i < 7; i++) *m[i] = read_mat();
        layers[l].ln1 = next("ln1").p;
        layers[l].ln2 = next("ln2").p;
    }
    hsd_model M = {mv[0], mv[1], mv[2], mv[3], mv[4], 0, eps[0], eps[1], layers};
    const int32_t *pv = next("passes").p;
    const int passes = pv[0], cache_len = pv[1];
    float **kc = malloc(L * sizeof(float *)), **vc = malloc(L * sizeof(float *));
    for (int l = 0; l < L; l++) {
        kc[l] = calloc((size_t)M.n_kv * cache_len * M.head_dim, sizeof(float));
        vc[l] = calloc((size_t)M.n_kv * cache_len * M.head_dim, sizeof(float));
    }
    float *const *kcs[1] = {kc}, *const *vcs[1] = {vc};
    for (int p = 0; p < passes; p++) {
        const int32_t *hv = next("pass").p;
        const int m = hv[0], start = hv[1];
        arr_t x = next("x"), cs = next("cos"), sn = next("sin"), want = next("out");
        int32_t *pos = malloc(m * sizeof(int32_t)), *seq = calloc(m, sizeof(int32_t)), lens[1] = {cache_len};
        for (int t = 0; t < m; t++) pos[t] = start + t;
        float *work = malloc(sizeof(float) * (size_t)hsd_work_floats(&M, m, cache_len, nt));
        if (hsd_layers(&M, 0, L, x.p, m, pos, seq, cs.p, sn.p, kcs, vcs, lens, work, nt) != 0)
            die("hsd_layers refused its arguments");
        char what[96];
        snprintf(what, sizeof what, "hsd_layers %d layers, pass %d (%d positions from %d)", L, p, m, start);
        check(what, x.p, &want, x.n);
        free(work);
    }
}

static void screen_case(int nt) {
    hsd_mat head = read_mat();
    const int32_t *sh = next("shape").p;
    const int V = sh[0], K = sh[1], m = sh[2], q16 = sh[3];
    arr_t packed = next("packed"), scale = next("rowscale"), c = next("c"), wn = next("wnorm"), x = next("x");
    arr_t wa = next("a"), we = next("e"), wids = next("ids");
    float *a = malloc(sizeof(float) * (size_t)m * V), *e = malloc(sizeof(float) * (size_t)m * V);
    int64_t *ids = malloc(sizeof(int64_t) * m);
    if (hsd_screen_i16(packed.p, scale.p, V, K, x.p, m, a, nt) != 0) die("hsd_screen_i16 refused its arguments");
    check("hsd_screen_i16", a, &wa, sizeof(float) * (size_t)m * V);
    if (hsd_screen_bounds(x.p, m, K, q16, c.p, wn.p, V, e) != 0) die("hsd_screen_bounds refused its arguments");
    check("hsd_screen_bounds", e, &we, sizeof(float) * (size_t)m * V);
    if (hsd_screen_pick(&head, x.p, m, q16, wa.p, NULL, c.p, wn.p, 1024, ids, nt) != 0)
        die("hsd_screen_pick refused its arguments");
    check("hsd_screen_pick", ids, &wids, sizeof(int64_t) * m);
    arr_t off = next("offsets"), wido = next("ids_offsets");
    if (hsd_screen_pick(&head, x.p, m, q16, wa.p, off.p, c.p, wn.p, 1024, ids, nt) != 0)
        die("hsd_screen_pick (offsets) refused its arguments");
    check("hsd_screen_pick offsets", ids, &wido, sizeof(int64_t) * m);
    arr_t rows = next("rows"), positions = next("positions"), want = next("picked");
    const int n = (int)(rows.n / 8);
    float *y = malloc(sizeof(float) * n);
    if (hsd_rows_f32(&head, rows.p, positions.p, n, x.p, y) != 0) die("hsd_rows_f32 refused its arguments");
    check("hsd_rows_f32", y, &want, sizeof(float) * n);
    float *win = malloc(sizeof(float) * (size_t)m * V), *work = malloc(sizeof(float) * (size_t)nt * 3 * V);
    long *cand = malloc(sizeof(long) * (size_t)m * 1024);
    int *counts = malloc(sizeof(int) * (size_t)m);
    for (int i = 0; i < 2; i++) {
        const int32_t *wv = next("window").p;
        const float *lim = next("limits").p;
        arr_t pp = next("pin_pos"), pi = next("pin_ids"), pv = next("pin_vals"), wo = next("window_out");
        if (hsd_screen_window(&head, x.p, m, q16, wa.p, wv[1] ? off.p : NULL, c.p, wn.p, wv[0], lim[0], lim[1], lim[2],
                              pp.p, pi.p, pv.p, wv[2], 1024, win, work, cand, counts, nt) != 0)
            die("hsd_screen_window refused its arguments");
        check(i ? "hsd_screen_window top-k, min-p, offsets, pins" : "hsd_screen_window top-k", win, &wo,
              sizeof(float) * (size_t)m * V);
        for (int t = 0; t < m; t++) { /* each position's ids: its finite columns, ascending */
            int j = 0;
            for (int r = 0; r < V; r++) {
                if (!isfinite(win[(size_t)t * V + r])) continue;
                if (j >= counts[t] || cand[(size_t)t * 1024 + j] != r) die("hsd_screen_window: ids not its columns");
                j++;
            }
            if (j != counts[t]) die("hsd_screen_window: more ids than columns");
        }
    }
}

/* hsd_exact_q4f and hsd_exact_q8f on exact weights (the form, and -1) and on weights one ulp off in one place (the
 * index of that weight, as hsd_exact_mismatch of the exact form names it too); hsd_screen_codes of a head. */
static void exact_case(int nt) {
    for (int kind = 0; kind < 2; kind++) {
        const int32_t *sh = next("shape").p;
        const int R = sh[0], K = sh[1];
        arr_t w = next("w"), moved = next("moved"), o0 = next("out0"), o1 = next("out1"), o2 = {NULL, 0};
        if (!kind) o2 = next("out2");
        arr_t want = next("ret");
        void *codes = malloc(o0.n), *scale = malloc(o1.n), *zero = kind ? NULL : malloc(o2.n);
        int64_t ret[3];
        ret[0] = kind ? hsd_exact_q8f(w.p, R, K, codes, scale, nt) : hsd_exact_q4f(w.p, R, K, codes, scale, zero, nt);
        check(kind ? "hsd_exact_q8f codes" : "hsd_exact_q4f codes", codes, &o0, o0.n);
        check(kind ? "hsd_exact_q8f scales" : "hsd_exact_q4f scales", scale, &o1, o1.n);
        if (!kind) check("hsd_exact_q4f minimums", zero, &o2, o2.n);
        const hsd_mat A = {kind ? HSD_Q8F : HSD_Q4F, R, K, 0, codes, scale, zero, NULL};
        ret[1] = hsd_exact_mismatch(&A, moved.p, nt);
        ret[2] = kind ? hsd_exact_q8f(moved.p, R, K, codes, scale, nt) : hsd_exact_q4f(moved.p, R, K, codes, scale, zero, nt);
        check(kind ? "hsd_exact_q8f / hsd_exact_mismatch results" : "hsd_exact_q4f / hsd_exact_mismatch results", ret,
              &want, sizeof ret);
    }
    const int32_t *sh = next("shape").p;
    const int V = sh[0], K = sh[1];
    arr_t w = next("w"), o0 = next("out0"), o1 = next("out1"), o2 = next("out2"), o3 = next("out3");
    void *codes = malloc(o0.n), *scale = malloc(o1.n), *rho = malloc(o2.n), *wnorm = malloc(o3.n);
    if (hsd_screen_codes(w.p, V, K, codes, scale, rho, wnorm, nt) != 0) die("hsd_screen_codes refused its arguments");
    check("hsd_screen_codes codes", codes, &o0, o0.n);
    check("hsd_screen_codes scales", scale, &o1, o1.n);
    check("hsd_screen_codes rho", rho, &o2, o2.n);
    check("hsd_screen_codes wnorm", wnorm, &o3, o3.n);
}

static void norm_case(void) {
    const int32_t *sh = next("shape").p;
    arr_t x = next("x"), w = next("weight"), want = next("out");
    float *out = malloc(x.n);
    hsd_rms_norm(x.p, sh[0], sh[1], w.p, 1e-5f, out);
    check("hsd_rms_norm", out, &want, x.n);
}

/* An elementwise function of n floats (hsd_exp_rows, hsd_log_rows) on the stored inputs. */
static void rows_case(const char *what, void (*fn)(const float *, int, float *)) {
    const int n = *(const int32_t *)next("n").p;
    arr_t x = next("x"), want = next("y");
    float *y = malloc(sizeof(float) * n);
    fn(x.p, n, y);
    check(what, y, &want, sizeof(float) * n);
}

static void gumbel_case(int nt) {
    const uint64_t key = *(const uint64_t *)next("key").p;
    const int n = *(const int32_t *)next("n").p;
    const float t = *(const float *)next("temperature").p;
    arr_t want = next("y");
    float *y = malloc(sizeof(float) * n);
    hsd_gumbel(key, n, t, y, nt);
    check("hsd_gumbel", y, &want, sizeof(float) * n);
}

/* hsd_filter_probs on the stored rows: shape (m, n, top_k), limits (temperature, top_p, min_p). */
static void filter_case(void) {
    const int32_t *sh = next("shape").p;
    const double *lim = next("limits").p;
    arr_t x = next("x"), want = next("y");
    float *y = malloc(sizeof(float) * (size_t)sh[0] * sh[1]);
    if (hsd_filter_probs(x.p, sh[0], sh[1], lim[0], lim[1], sh[2], lim[2], y) != 0)
        die("hsd_filter_probs refused its arguments");
    check("hsd_filter_probs", y, &want, sizeof(float) * (size_t)sh[0] * sh[1]);
}

int main(int argc, char **argv) {
    if (argc != 2 || !(in = fopen(argv[1], "rb"))) die("usage: check_kernels CASES.bin");
    const int nt = 2;
    printf("build: hsd_simd %d, hsd_features %d\n", hsd_simd(), hsd_features());
    for (;;) {
        arr_t c = next("case");
        char kind[16] = {0};
        memcpy(kind, c.p, c.n < 15 ? c.n : 15);
        if (!strcmp(kind, "end")) break;
        if (!strcmp(kind, "linear")) linear_case(nt);
        else if (!strcmp(kind, "layers")) layers_case(nt);
        else if (!strcmp(kind, "screen")) screen_case(nt);
        else if (!strcmp(kind, "exact")) exact_case(nt);
        else if (!strcmp(kind, "norm")) norm_case();
        else if (!strcmp(kind, "exp")) rows_case("hsd_exp_rows", hsd_exp_rows);
        else if (!strcmp(kind, "gumbel")) gumbel_case(nt);
        else if (!strcmp(kind, "log")) rows_case("hsd_log_rows", hsd_log_rows);
        else if (!strcmp(kind, "filter")) filter_case();
        else die("unknown case");
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
