//! Recording an executable's steps: maximal runs of device steps become
//! CUDA graphs (segments), host steps run between them, and small matmuls'
//! weights are prefetched into L2 on a side branch of the graph.

use rlx_runtime::Result;

use crate::driver::{Event, Func, GraphExec, Stream};
use crate::launch::Step;
use crate::modules::Kernels;

/// A maximal run of steps: recorded once (replay) or a host-side run.
pub(crate) enum Segment {
    /// `prefetches`: L2 weight prefetches recorded beside the steps.
    Replay {
        steps: std::ops::Range<usize>,
        graph: GraphExec,
        prefetches: usize,
    },
    Host {
        steps: std::ops::Range<usize>,
    },
}

/// Matmuls of at most this many rows get their weight prefetched into L2
/// while the matmul before them runs: at batch 1 bert-base reads 170 MB of
/// weights per forward, more than the L2 holds, and the prefetch saved
/// about 8 % at 1×128 on the H200. At 256 rows and more it measured slower
/// (the prefetch blocks likely take SMs the larger matmuls would use).
pub(crate) const PREFETCH_MAX_ROWS: usize = 128;

/// A second stream that recorded graphs fork to for L2 weight prefetches.
pub(crate) struct Prefetcher<'a> {
    pub side: Stream,
    pub fork: Event,
    pub join: Event,
    pub kernels: &'a Kernels,
}

/// Splits steps into segments and records each replayable one as a graph.
/// `fill` (the fill kernel) turns memset nodes into kernel nodes; with
/// `prefetch`, marked matmuls' weights are prefetched into L2 on a second
/// branch of the graph, joined at the segment's end; `dump` prints each
/// graph's nodes.
pub(crate) fn record(
    stream: &Stream,
    steps: &[Step],
    fill: Option<Func>,
    window: Option<(u64, usize, f32)>,
    dump: bool,
    prefetch: Option<&Prefetcher>,
) -> Result<Vec<Segment>> {
    let mut segs = Vec::new();
    let mut i = 0;
    while i < steps.len() {
        let host = steps[i].host;
        let mut j = i;
        while j < steps.len() && steps[j].host == host {
            j += 1;
        }
        if host {
            segs.push(Segment::Host { steps: i..j });
        } else {
            // Each marked matmul's weight is prefetched into L2 from when the
            // marked matmul before it starts (the first one's from the
            // segment's start): (fork before this step, weight).
            let mms: Vec<(usize, (u64, u64))> =
                steps.iter().enumerate().take(j).skip(i).filter_map(|(s, st)| st.weight.map(|w| (s, w))).collect();
            let forks: Vec<(usize, (u64, u64))> =
                mms.iter().enumerate().map(|(k, &(_, w))| (if k > 0 { mms[k - 1].0 } else { i }, w)).collect();
            let graph = GraphExec::capture(stream, fill, window, dump, || {
                for (s, st) in steps.iter().enumerate().take(j).skip(i) {
                    if let Some(p) = prefetch {
                        let mut forked = false;
                        for (_, (ptr, bytes)) in forks.iter().filter(|f| f.0 == s) {
                            if !forked {
                                p.fork.record(stream)?;
                                p.side.wait(&p.fork)?;
                                forked = true;
                            }
                            p.kernels.prefetch_l2(*ptr, *bytes)?.enqueue(&p.side)?;
                        }
                    }
                    st.enqueue(stream)?;
                }
                if let (Some(p), false) = (prefetch, forks.is_empty()) {
                    p.join.record(&p.side)?;
                    stream.wait(&p.join)?;
                }
                Ok(())
            })?;
            segs.push(Segment::Replay { steps: i..j, graph, prefetches: if prefetch.is_some() { forks.len() } else { 0 } });
        }
        i = j;
    }
    Ok(segs)
}
