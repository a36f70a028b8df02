//! Admitting several prompts at once ([`Generator::add_sequences`]):
//! whether to prefill them side by side in shared steps over several slots
//! or one at a time, and the side-by-side prefill itself.

use super::*;

impl Generator {
    /// Prefills several prompts into free slots (the lowest ones, in order),
    /// each with its own sampling settings; returns each one's slot and
    /// first token, or why it was refused, in the prompts' order. They are
    /// prefilled side by side where that costs less than one at a time (as
    /// [`add_sequence`](Self::add_sequence)), counting each step's tokens
    /// and its fixed cost (`CHUNK_OVERHEAD` on the CPU, `GPU_STEP_OVERHEAD`
    /// on a GPU): chunks of one prefill step over slots `0..w` (`w` the
    /// decode width that holds the highest slot being prefilled; the slots
    /// past it are not touched), in which the rows of the other slots run
    /// along harmlessly (a running sequence's
    /// row feeds its pending token at its own position, which the next
    /// decode step writes again; a free slot's row writes past the prefix
    /// it keeps). Not where a slot is too near the end of its context for a
    /// chunk. The tokens are the same either way.
    pub fn add_sequences(&mut self, prompts: &[(Vec<u32>, SamplingParams)]) -> Vec<Result<BatchEvent>> {
        self.admit(prompts, false)
    }

    /// As [`add_sequences`](Self::add_sequences), prefilling side by side
    /// whatever it costs, wherever a chunk fits every slot of the step
    /// (else one at a time).
    pub fn add_sequences_side_by_side(&mut self, prompts: &[(Vec<u32>, SamplingParams)]) -> Vec<Result<BatchEvent>> {
        self.admit(prompts, true)
    }

    fn admit(&mut self, prompts: &[(Vec<u32>, SamplingParams)], side_by_side: bool) -> Vec<Result<BatchEvent>> {
        let mut out: Vec<Option<Result<BatchEvent>>> = prompts.iter().map(|_| None).collect();
        let free: Vec<usize> = (0..self.opts.batch).filter(|&r| self.slots[r].is_none()).collect();
        let mut joint = Vec::new(); // (prompt index, slot)
        for (i, (ids, params)) in prompts.iter().enumerate() {
            if let Err(e) = self.check_prompt(ids, params) {
                out[i] = Some(Err(e));
            } else if joint.len() < free.len() {
                joint.push((i, free[joint.len()]));
            } else {
                out[i] = Some(Err(ModelError::Input(format!(
                    "all {} slots hold a sequence; remove one or wait for one to finish",
                    self.opts.batch
                ))));
            }
        }
        let chunk = if side_by_side || joint.len() >= 2 { self.joint_chunk(&joint, prompts) } else { None };
        match chunk.filter(|&b| side_by_side || self.joint_pays(&joint, prompts, b)) {
            Some(b) => {
                let firsts = self.prefill_joint(&joint, prompts, b);
                for (&(i, slot), first) in joint.iter().zip(firsts) {
                    out[i] = Some(first.and_then(|(cached, f)| self.start_sequence(slot, &prompts[i].1, cached, f)));
                }
            }
            _ => {
                for (i, _) in joint {
                    out[i] = Some(self.add_sequence(&prompts[i].0, &prompts[i].1));
                }
            }
        }
        out.into_iter().map(|r| r.unwrap_or_else(|| Err(ModelError::Input("prompt not admitted".into())))).collect()
    }

    /// The chunk of a joint prefill of `joint` (prompt index, slot): the
    /// largest bucket within `JOINT_PREFILL_TOKENS` over the step's slots
    /// such that every one's chunk, written from its position, fits its context
    /// in every round. `None`: none fits.
    fn joint_chunk(&self, joint: &[(usize, usize)], prompts: &[(Vec<u32>, SamplingParams)]) -> Option<usize> {
        let (w, ctx) = (self.joint_width(joint), self.opts.ctx_size);
        let member = self.joint_members(joint);
        self.opts.prefill_buckets.iter().copied().rev().find(|&b| {
            w * b <= JOINT_PREFILL_TOKENS
                && (0..w).all(|r| match member[r] {
                    // Its chunks end before len + b, and once its prompt is
                    // in, it runs along from len.
                    Some(k) => prompts[joint[k].0].0.len() + b <= ctx,
                    None => self.joint_idle_pos(r) + b <= ctx,
                })
        })
    }

    /// The rows of a joint prefill of `joint` (prompt index, slot): slots
    /// `0..w` for the decode width `w` that holds the highest of them. The
    /// slots past it are not touched.
    fn joint_width(&self, joint: &[(usize, usize)]) -> usize {
        self.width_for(joint.iter().map(|&(_, s)| s).max().unwrap_or(0))
    }

    /// Per slot, its index in `joint` (prompt index, slot), if any.
    fn joint_members(&self, joint: &[(usize, usize)]) -> Vec<Option<usize>> {
        let mut member = vec![None; self.opts.batch];
        for (k, &(_, s)) in joint.iter().enumerate() {
            member[s] = Some(k);
        }
        member
    }

    /// Whether prefilling `joint` side by side in chunks of `b` costs less
    /// than one prompt at a time, in prompt-token equivalents: each step's
    /// tokens (every slot's chunk, or the padded chunks `plan_chunk` picks)
    /// plus its fixed cost on this device.
    fn joint_pays(&self, joint: &[(usize, usize)], prompts: &[(Vec<u32>, SamplingParams)], b: usize) -> bool {
        let overhead = match self.session.device() {
            Device::Cpu => CHUNK_OVERHEAD,
            Device::Cuda(_) => GPU_STEP_OVERHEAD,
        };
        let (buckets, ctx) = (&self.opts.prefill_buckets, self.opts.ctx_size);
        let mut alone = 0;
        let mut left = vec![];
        for &(i, s) in joint {
            let ids = &prompts[i].0;
            let mut at = self.reused_prefix(s, ids);
            left.push(ids.len() - at);
            while at < ids.len() {
                let chunk = plan_chunk(buckets, ids.len() - at, ctx - at);
                alone += chunk + overhead;
                at += chunk.min(ids.len() - at);
            }
        }
        let w = self.joint_width(joint);
        let side_by_side: usize = self.joint_rounds(left, b).iter().map(|&c| w * c + overhead).sum();
        side_by_side < alone
    }

    /// The chunk of each round of a joint prefill capped at `b`, for
    /// prompts with `left` tokens to feed: each round the smallest bucket
    /// (up to `b`) that holds what the longest has left, so the last round
    /// pads the least.
    fn joint_rounds(&self, mut left: Vec<usize>, b: usize) -> Vec<usize> {
        let mut rounds = vec![];
        while let Some(&most) = left.iter().max().filter(|&&m| m > 0) {
            let c = self.joint_round_chunk(most, b);
            left.iter_mut().for_each(|l| *l = l.saturating_sub(c));
            rounds.push(c);
        }
        rounds
    }

    /// The smallest bucket up to `b` that holds `most` tokens, else `b`.
    fn joint_round_chunk(&self, most: usize, b: usize) -> usize {
        self.opts.prefill_buckets.iter().copied().filter(|&c| c <= b && c >= most).min().unwrap_or(b)
    }

    /// Where a slot not being prefilled writes in a joint prefill: a running
    /// sequence at its position (its pending token goes there again), a
    /// free slot past the tokens it keeps for reuse.
    fn joint_idle_pos(&self, slot: usize) -> usize {
        if self.slots[slot].is_some() {
            self.slot_pos[slot]
        } else {
            self.kv[slot].len()
        }
    }

    /// The prompt tokens of `prompt` already in `slot`'s cache (at least the
    /// last one is fed again: its logits give the first new token).
    fn reused_prefix(&self, slot: usize, prompt: &[u32]) -> usize {
        self.kv[slot].iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1)
    }

    /// Prefills the prompts of `joint` side by side in chunks of up to `b`
    /// tokens over the step's slots; returns each one's (reused tokens, first token, its
    /// logits). On an error the slots of `joint` forget their cached tokens
    /// (the others' rows were written only past what they keep).
    fn prefill_joint(
        &mut self,
        joint: &[(usize, usize)],
        prompts: &[(Vec<u32>, SamplingParams)],
        b: usize,
    ) -> Vec<Result<(usize, FirstToken)>> {
        let reused: Vec<usize> = joint.iter().map(|&(i, s)| self.reused_prefix(s, &prompts[i].0)).collect();
        let res = self.prefill_joint_rounds(joint, prompts, &reused, b);
        match res {
            Ok(firsts) => {
                for &(i, s) in joint {
                    self.kv[s] = prompts[i].0.clone();
                    self.slot_pos[s] = prompts[i].0.len();
                }
                firsts.into_iter().zip(reused).map(|(f, c)| Ok((c, f))).collect()
            }
            Err(e) => {
                joint.iter().for_each(|&(_, s)| self.kv[s].clear());
                joint.iter().map(|_| Err(ModelError::Input(format!("joint prefill: {e}")))).collect()
            }
        }
    }

    fn prefill_joint_rounds(
        &mut self,
        joint: &[(usize, usize)],
        prompts: &[(Vec<u32>, SamplingParams)],
        reused: &[usize],
        b: usize,
    ) -> Result<Vec<FirstToken>> {
        let (w, v) = (self.joint_width(joint), self.config.vocab);
        let mut at: Vec<usize> = reused.to_vec();
        let mut firsts: Vec<Option<FirstToken>> = joint.iter().map(|_| None).collect();
        let mut member = self.joint_members(joint);
        member.truncate(w);
        let rows: Vec<Option<&SamplingParams>> = member.iter().map(|m| m.map(|k| &prompts[joint[k].0].1)).collect();
        let (f, ip) = sampling_tensors(&rows)?;
        while firsts.iter().any(Option::is_none) {
            // This round's chunk: the bucket that holds what the longest
            // prompt has left, up to `b`.
            let most = joint.iter().enumerate().filter(|(k, _)| firsts[*k].is_none()).map(|(k, &(i, _))| prompts[i].0.len() - at[k]).max();
            let b = self.joint_round_chunk(most.unwrap_or(b), b);
            let (mut ids, mut pos) = (Vec::with_capacity(w * b), Vec::with_capacity(w * b));
            let (mut start, mut valid, mut last_row, mut next_pos, mut slot_row) = (vec![], vec![], vec![], vec![], vec![]);
            for (r, &m) in member.iter().enumerate() {
                let k = m.filter(|&k| firsts[k].is_none());
                let (from, n) = match k {
                    Some(k) => {
                        let prompt = &prompts[joint[k].0].0;
                        let n = (prompt.len() - at[k]).min(b);
                        let chunk = &prompt[at[k]..at[k] + n];
                        ids.extend(chunk.iter().map(|&t| t as i32));
                        ids.extend(std::iter::repeat_n(chunk[n - 1] as i32, b - n));
                        (at[k], n)
                    }
                    None => {
                        // Runs along: its pending token at its own position
                        // (a prompt done in an earlier chunk: its first new
                        // token after the prompt; a running sequence: its
                        // next token; a free slot: 0 past the prefix it
                        // keeps); its token and position go to the dump row.
                        let (p, pending) = match m {
                            Some(k) => (prompts[joint[k].0].0.len(), firsts[k].as_ref().map_or(0, |f| f.0)),
                            None => (self.joint_idle_pos(r), self.slots[r].as_ref().and_then(|x| x.ids.last().copied()).unwrap_or(0)),
                        };
                        ids.extend(std::iter::repeat_n(pending as i32, b));
                        (p, 1)
                    }
                };
                pos.extend((0..b).map(|j| (from + j) as i32));
                start.push(from as i32);
                valid.push((from + b) as i32);
                last_row.push((r * b + n - 1) as i32);
                next_pos.push((from + n) as i32);
                slot_row.push(if k.is_some() { 0 } else { 1 });
            }
            let t = |shape: &[usize], v: &[i32]| Tensor::from_i32(shape.to_vec(), v);
            let inputs = [
                (io::IDS, t(&[w, b], &ids)?),
                (io::POSITIONS, t(&[w, b], &pos)?),
                (io::START, t(&[w], &start)?),
                (io::VALID, t(&[w], &valid)?),
                (io::LAST_ROW, t(&[w], &last_row)?),
                (io::NEXT_POS, t(&[w], &next_pos)?),
                (io::SLOT_ROW, t(&[w], &slot_row)?),
            ];
            let mut named: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
            named.push((io::FPARAMS, &f));
            named.push((io::IPARAMS, &ip));
            let out = self.joint_prefill_exe(w, b)?.run(&named)?;
            let tokens = out.first().map(|t| t.to_i32()).ok_or_else(|| ModelError::Input("prefill returned no token".into()))?;
            let logits = out.get(1).map(|l| l.to_f32());
            for (k, &(i, s)) in joint.iter().enumerate() {
                if firsts[k].is_some() {
                    continue;
                }
                let n = (prompts[i].0.len() - at[k]).min(b);
                at[k] += n;
                if at[k] == prompts[i].0.len() {
                    let missing = || ModelError::Input(format!("prefill returned no token or logits for slot {s}"));
                    let token = *tokens.get(s).ok_or_else(missing)?;
                    let row = match &logits {
                        Some(l) => Some(l.get(s * v..(s + 1) * v).ok_or_else(missing)?.to_vec()),
                        None => None,
                    };
                    firsts[k] = Some((token as u32, row));
                }
            }
        }
        Ok(firsts.into_iter().flatten().collect())
    }

    /// The chunk sizes of the prefill steps over several slots compiled so
    /// far (`add_sequences`), at any width, smallest first.
    pub fn joint_prefill_chunks(&self) -> Vec<usize> {
        let mut chunks: Vec<usize> = self.joint_prefill.keys().map(|k| k.1).collect();
        chunks.sort_unstable();
        chunks.dedup();
        chunks
    }

    /// The (width, chunk) of each prefill step over several slots compiled
    /// so far.
    pub fn joint_prefill_shapes(&self) -> Vec<(usize, usize)> {
        self.joint_prefill.keys().copied().collect()
    }

    pub(super) fn joint_prefill_exe(&mut self, width: usize, bucket: usize) -> Result<&mut CompiledGraph> {
        if !self.joint_prefill.contains_key(&(width, bucket)) {
            let exe = self.compile_step(width, bucket, false, 0)?;
            self.joint_prefill.insert((width, bucket), exe);
        }
        self.joint_prefill.get_mut(&(width, bucket)).ok_or_else(|| ModelError::Input("joint prefill step missing".into()))
    }
}
