//! A generation in progress ([`Generation`]): the iterator that submits
//! decode steps ahead and hands out the text as it becomes final.

use super::*;

/// A generation in progress: an iterator of [`Piece`]s. Dropping it early
/// stops the generation (steps in flight are waited for).
pub struct Generation<'g> {
    pub(super) gen: &'g mut Generator,
    pub(super) params: SamplingParams,
    pub(super) stream: TextStream,
    pub(super) f: Tensor,
    pub(super) i: Tensor,
    pub(super) step: Tensor,
    pub(super) pending: VecDeque<Ticket>,
    /// The token to hand out next, when already known.
    pub(super) next: Option<(u32, Option<Vec<f32>>)>,
    /// Decode steps submitted so far.
    pub(super) submitted: usize,
    pub(super) done: Option<StopReason>,
    pub(super) ids: Vec<u32>,
    pub(super) decode_start: Option<Instant>,
    pub(super) stats: GenerationStats,
    /// Time spent waiting on the device during the current `next` call.
    pub(super) waited: Duration,
}

impl Generation<'_> {
    /// Why it ended (`None` while running).
    pub fn stop_reason(&self) -> Option<&StopReason> {
        self.done.as_ref()
    }

    /// The new token ids handed out so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn stats(&self) -> &GenerationStats {
        &self.stats
    }

    /// Runs to the end; returns the text.
    pub fn collect_text(&mut self) -> Result<String> {
        let mut s = String::new();
        for p in self.by_ref() {
            s.push_str(&p?.text);
        }
        Ok(s)
    }

    /// Position of the token decode step `k` feeds: the prompt, then the
    /// tokens handed out before it.
    fn step_position(&self, k: usize) -> usize {
        self.stats.prompt_tokens + k
    }

    /// Keeps up to `pipeline` decode steps in flight, within max_tokens and
    /// the cache.
    fn fill(&mut self) -> Result<()> {
        while self.pending.len() < self.gen.opts.pipeline {
            // Step k produces new token k+1; its history write lands at
            // position p+1, which must be a cache row.
            let k = self.submitted;
            if k + 1 >= self.params.max_tokens || self.step_position(k) + 1 >= self.gen.opts.ctx_size {
                break;
            }
            let exe = self.gen.decode_exe(1)?;
            let t = exe.submit(&[(io::FPARAMS, &self.f), (io::IPARAMS, &self.i), (io::STEP, &self.step)])?;
            self.pending.push_back(t);
            self.submitted += 1;
        }
        Ok(())
    }

    /// Waits out the steps still in flight (they may write the shared
    /// state, so nothing else may run before they finish).
    fn drain(&mut self) {
        let t0 = Instant::now();
        while let Some(t) = self.pending.pop_front() {
            if let Ok(exe) = self.gen.decode_exe(1) {
                let _ = exe.wait(t);
            }
        }
        self.waited += t0.elapsed();
        if let Some(s) = self.decode_start.take() {
            self.stats.decode_time = s.elapsed();
        }
    }

    fn finish(&mut self, reason: StopReason) {
        self.drain();
        // Keys and values of the prompt and of every token fed to a kept
        // step stay valid for the next call.
        let fed = self.ids.len().saturating_sub(1);
        self.gen.kv[0].extend_from_slice(&self.ids[..fed]);
        self.done = Some(reason);
    }

    fn advance(&mut self) -> Result<Option<Piece>> {
        if self.done.is_some() {
            return Ok(None);
        }
        let (token, logits) = match self.next.take() {
            Some(x) => x,
            None => {
                let Some(t) = self.pending.pop_front() else {
                    // Unreachable in order: the step that handed out the
                    // last token already finished the generation.
                    self.finish(StopReason::ContextFull);
                    return Ok(None);
                };
                let t0 = Instant::now();
                let out = self.gen.decode_exe(1)?.wait(t);
                self.waited += t0.elapsed();
                let out = out?;
                let token = out
                    .first()
                    .and_then(|t| t.to_i32().first().copied())
                    .ok_or_else(|| ModelError::Input("decode returned no token".into()))?;
                let v = self.gen.config.vocab;
                (token as u32, out.get(1).map(|l| l.to_f32()[..v].to_vec()))
            }
        };
        if self.decode_start.is_none() {
            self.decode_start = Some(Instant::now());
        }
        self.ids.push(token);
        self.stats.generated = self.ids.len();
        if self.gen.eos.contains(&token) && !self.params.ignore_eos {
            let rest = self.stream.finish().map_err(|e| ModelError::Input(e.to_string()))?;
            self.finish(StopReason::Eos);
            return Ok(Some(Piece { text: rest.text().to_string(), token, logits }));
        }
        self.fill()?;
        let step = self.stream.push(token).map_err(|e| ModelError::Input(e.to_string()))?;
        let mut text = step.text().to_string();
        if let StreamStep::Stopped { stop, .. } = &step {
            let stop = stop.clone();
            self.finish(StopReason::StopString(stop));
            return Ok(Some(Piece { text, token, logits }));
        }
        if self.ids.len() >= self.params.max_tokens || (self.pending.is_empty() && self.next.is_none()) {
            let rest = self.stream.finish().map_err(|e| ModelError::Input(e.to_string()))?;
            text.push_str(rest.text());
            let reason = if self.ids.len() >= self.params.max_tokens { StopReason::MaxTokens } else { StopReason::ContextFull };
            self.finish(reason);
        }
        Ok(Some(Piece { text, token, logits }))
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Piece>;
    fn next(&mut self) -> Option<Self::Item> {
        let t0 = Instant::now();
        self.waited = Duration::ZERO;
        let r = self.advance();
        // The first call hands out the prompt's token: decode starts after it.
        if self.stats.generated > 1 {
            self.stats.host_time += t0.elapsed().saturating_sub(self.waited);
        }
        match r {
            Ok(Some(p)) => Some(Ok(p)),
            Ok(None) => None,
            Err(e) => {
                self.drain();
                self.gen.kv[0].clear();
                self.done = Some(StopReason::MaxTokens);
                Some(Err(e))
            }
        }
    }
}

impl Drop for Generation<'_> {
    fn drop(&mut self) {
        if self.done.is_none() {
            self.finish(StopReason::MaxTokens);
        }
    }
}
