/* A floor for the optimizer step with two 8-bit block-scaled states (benchmarks/bench_optim.py --floor).

   AdamW's step over 128-element blocks as engine's fused FP8 / int8 loop runs it (decode both states, update,
   block maxima, encode, update the weight from the stored values), with the cheapest 8-bit code there is: a
   LINEAR int8 code, one conversion each way. It is not a format engine offers (a linear code loses Adam's small
   second moments), and it is compiled with -ffast-math: no NaN, rounding or scale-rule care. Any real 8-bit
   state (FP8's exponent, the dynamic map's search) costs more, so no fused step with two 8-bit states can be
   faster than this one on the machine that runs it. */
#include <math.h>
#include <stdint.h>

void floor_step(float* restrict w, const float* restrict g, int8_t* restrict m, int8_t* restrict v,
                float* restrict m_scale, float* restrict v_scale, long n, float beta1, float beta2, float lr,
                float eps, float decay) {
  float mb[128], vb[128];
  for (long b = 0; b < n / 128; ++b) {
    int8_t* mc = m + b * 128;
    int8_t* vc = v + b * 128;
    const float* gc = g + b * 128;
    float* wc = w + b * 128;
    const float ms = m_scale[b], vs = v_scale[b];
    float m_amax = 0.f, v_amax = 0.f;
    for (int i = 0; i < 128; ++i) {
      const float gi = gc[i];
      mb[i] = (float)mc[i] * ms * beta1 + gi * (1 - beta1);
      vb[i] = (float)vc[i] * vs * beta2 + gi * gi * (1 - beta2);
      m_amax = fmaxf(m_amax, fabsf(mb[i]));
      v_amax = fmaxf(v_amax, fabsf(vb[i]));
    }
    const float mq = 127.f / m_amax, vq = 127.f / v_amax, md = m_amax / 127.f, vd = v_amax / 127.f;
    m_scale[b] = md;
    v_scale[b] = vd;
    for (int i = 0; i < 128; ++i) {
      const int32_t cm = (int32_t)rintf(mb[i] * mq), cv = (int32_t)rintf(vb[i] * vq);
      mc[i] = (int8_t)cm;
      vc[i] = (int8_t)cv;
      wc[i] = wc[i] * decay - lr * ((float)cm * md) / (sqrtf((float)cv * vd) + eps);
    }
  }
}
