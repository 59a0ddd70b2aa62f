//! Negotiation, without I/O: rank 0 feeds every rank's requests in and gets
//! back the responses to send, in one total order that every rank then
//! follows. A name becomes ready when every member of its process set has
//! asked for it (or joined, for allreduce); ready names are checked for
//! agreement, fused, and answered. Being pure, it is tested without sockets.

use super::autotune::Tuner;
use super::message::{OpKind, Request, Response, WireRequest};
use super::offline::Detector;
use super::outgoing::Outgoing;
use crate::config::StallLimits;
use crate::plan::Plan;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Pending {
    seq: u64,
    /// Each member's request (shared with the response cache and between members
    /// that sent the same cached id: a step of cached requests allocates nothing).
    reqs: Vec<Option<Arc<Request>>>,
    /// Members it still waits for: no request from them, and neither joined nor shut
    /// down. Kept as requests, joins and shutdowns come, so that finding the ready
    /// names costs a look at each, not at each member of each.
    waiting: usize,
    /// When the first rank asked for it.
    since: Instant,
    /// A stall warning about it was given.
    warned: bool,
}

/// What a stall check found: warnings to print, and the abort to send.
#[derive(Default)]
pub struct Stalls {
    /// One line per name newly past the warning limit.
    pub warnings: Vec<String>,
    /// An abort for every rank, when a name is past the shutdown limit.
    pub abort: Outgoing,
}

struct SetState {
    members: Vec<usize>,
    /// Each member's index in `members`, by rank.
    index: HashMap<usize, usize>,
    pending: HashMap<String, Pending>,
    joined: Vec<bool>,
    /// How many members have joined.
    joins: usize,
    last_joined: usize,
}

impl SetState {
    fn new(members: Vec<usize>) -> SetState {
        let n = members.len();
        SetState {
            index: members.iter().enumerate().map(|(i, &m)| (m, i)).collect(),
            members,
            pending: HashMap::new(),
            joined: vec![false; n],
            joins: 0,
            last_joined: 0,
        }
    }

    /// Member `i` no longer counts as waited for (it joined or shut down): every name
    /// that lacked its request waits for one member less.
    fn excuse(&mut self, i: usize) {
        for p in self.pending.values_mut() {
            if p.reqs[i].is_none() {
                p.waiting -= 1;
            }
        }
    }

    /// Every member that joined counts as waited for again (`shut`: by rank).
    fn unjoin_all(&mut self, shut: &[bool]) {
        for i in 0..self.members.len() {
            if self.joined[i] && !shut[self.members[i]] {
                for p in self.pending.values_mut() {
                    if p.reqs[i].is_none() {
                        p.waiting += 1;
                    }
                }
            }
        }
        self.joined.iter_mut().for_each(|j| *j = false);
        self.joins = 0;
    }
}

/// A process set that its own members are forming (FormProcessSet).
struct Forming {
    /// The name each member asked under, by position in the set.
    names: Vec<Option<String>>,
    since: Instant,
    warned: bool,
}

/// The coordinator's state.
pub struct Coordinator {
    fusion_threshold: usize,
    sets: BTreeMap<u32, SetState>,
    /// Sets being formed by their members alone, by their sorted ranks.
    forming: BTreeMap<Vec<usize>, Forming>,
    next_set_id: u32,
    seq: u64,
    shut: Vec<bool>,
    cache: Vec<Arc<Request>>,
    cache_index: HashMap<(u32, String), u32>,
    cache_capacity: usize,
    offline: Option<Box<Detector>>,
    autotune: Option<Box<Tuner>>,
    stall: StallLimits,
}

impl Coordinator {
    /// Enables the stall check.
    pub fn with_stall_limits(mut self, stall: StallLimits) -> Coordinator {
        self.stall = stall;
        self
    }

    /// True when a stall check may find something: it is on and some name
    /// waits for ranks.
    pub fn stall_watch(&self) -> bool {
        (self.stall.warn.is_some() || self.stall.fail.is_some()) && self.waiting()
    }

    /// True while some name (or a process set being formed) waits for ranks.
    pub fn waiting(&self) -> bool {
        self.sets.values().any(|s| !s.pending.is_empty()) || !self.forming.is_empty()
    }

    /// True when `rank` announced its shutdown (it is not waited for any more).
    pub fn has_shut(&self, rank: usize) -> bool {
        self.shut.get(rank).copied().unwrap_or(false)
    }

    /// Names some ranks asked for and others have not, waiting longer than
    /// the limits at `now`: a warning for each newly past the warning limit,
    /// and an abort for the whole job once one is past the shutdown limit.
    pub fn check_stalls(&mut self, now: Instant) -> Stalls {
        let mut found = Stalls::default();
        let mut worst: Option<(Duration, String)> = None;
        for (id, set) in &mut self.sets {
            for (name, p) in &mut set.pending {
                let waited = now.saturating_duration_since(p.since);
                let waiting: Vec<usize> = (0..set.members.len())
                    .filter(|&i| p.reqs[i].is_some())
                    .map(|i| set.members[i])
                    .collect();
                let missing: Vec<usize> = (0..set.members.len())
                    .filter(|&i| p.reqs[i].is_none() && !set.joined[i])
                    .map(|i| set.members[i])
                    .collect();
                let Some(kind) = p.reqs.iter().flatten().next().map(|r| r.kind.name()) else {
                    continue;
                };
                let set_txt = if *id == 0 {
                    String::new()
                } else {
                    format!(" in process set {id}")
                };
                let what = format!(
                    "{kind} '{name}'{set_txt} has waited {:.0} s for ranks {} \
                     (ranks {} submitted it)",
                    waited.as_secs_f64(),
                    ranks_text(&missing),
                    ranks_text(&waiting)
                );
                self.stall
                    .judge(waited, what, &mut p.warned, &mut found, &mut worst);
            }
        }
        for (ranks, f) in &mut self.forming {
            let waited = now.saturating_duration_since(f.since);
            let who = |asked: bool| -> Vec<usize> {
                ranks
                    .iter()
                    .zip(&f.names)
                    .filter(|(_, n)| n.is_some() == asked)
                    .map(|(&m, _)| m)
                    .collect()
            };
            let what = format!(
                "form_process_set of ranks {ranks:?} has waited {:.0} s for ranks {} \
                 (ranks {} asked for it)",
                waited.as_secs_f64(),
                ranks_text(&who(false)),
                ranks_text(&who(true))
            );
            self.stall
                .judge(waited, what, &mut f.warned, &mut found, &mut worst);
        }
        if let Some((_, what)) = worst {
            let limit = self.stall.fail.unwrap_or_default().as_secs();
            let message = format!(
                "stalled: {what}; stopping the job after \
                 PERSEUS_STALL_SHUTDOWN_TIME_SECONDS={limit}"
            );
            let all: Vec<usize> = (0..self.shut.len()).collect();
            found.abort.push((all, Response::Abort { message }));
        }
        found
    }

    /// Enables the response cache with room for `capacity` signatures.
    pub fn with_cache(mut self, capacity: usize) -> Coordinator {
        self.cache_capacity = capacity;
        self
    }

    /// Enables offline negotiation (PERSEUS_OFFLINE_NEG, see [`super::offline`]).
    pub fn with_offline(mut self, on: bool) -> Coordinator {
        self.offline = on.then(|| Box::new(Detector::new(self.shut.len())));
        self
    }

    /// Enables autotuning (HOROVOD_AUTOTUNE, see [`super::autotune`]). Offline
    /// negotiation waits until the tuner is done, since the tuner learns from
    /// the answers the schedule would replace.
    pub fn with_autotune(mut self, tuner: Option<Tuner>) -> Coordinator {
        self.autotune = tuner.map(Box::new);
        self
    }

    /// Expands cached ids, then does what [`Coordinator::submit`] does.
    pub fn submit_wire(&mut self, rank: usize, reqs: Vec<WireRequest>) -> Outgoing {
        let mut full = Vec::with_capacity(reqs.len());
        for r in reqs {
            match r {
                WireRequest::Full(r) => full.push(Arc::new(r)),
                WireRequest::Cached(id) => match self.cache.get((id as usize).wrapping_sub(1)) {
                    Some(r) => full.push(r.clone()),
                    None => return self.disconnect(rank, &format!("sent unknown cache id {id}")),
                },
            }
        }
        self.submit_shared(rank, full)
    }

    /// Changes the largest fused buffer for responses formed from now on.
    pub fn set_fusion_threshold(&mut self, bytes: usize) {
        self.fusion_threshold = bytes;
    }

    /// A coordinator for `size` ranks; process set 0 holds them all.
    pub fn new(size: usize, fusion_threshold: usize) -> Coordinator {
        let mut sets = BTreeMap::new();
        sets.insert(0, SetState::new((0..size).collect()));
        Coordinator {
            fusion_threshold,
            sets,
            forming: BTreeMap::new(),
            next_set_id: 1,
            seq: 0,
            shut: vec![false; size],
            cache: Vec::new(),
            cache_index: HashMap::new(),
            cache_capacity: 0,
            offline: None,
            autotune: None,
            stall: StallLimits::default(),
        }
    }

    /// Takes a batch of requests from `rank` and returns what to send.
    pub fn submit(&mut self, rank: usize, reqs: Vec<Request>) -> Outgoing {
        self.submit_shared(rank, reqs.into_iter().map(Arc::new).collect())
    }

    /// [`Coordinator::submit`] of requests that may be shared with the cache.
    fn submit_shared(&mut self, rank: usize, reqs: Vec<Arc<Request>>) -> Outgoing {
        let mut out = Outgoing::new();
        for req in reqs {
            if req.kind == OpKind::OfflineAck {
                if let Some(d) = &mut self.offline {
                    d.ack(rank);
                }
                continue;
            }
            if req.kind == OpKind::FormProcessSet {
                self.ask_to_form(rank, &req, &mut out);
                continue;
            }
            let Some(set) = self.sets.get_mut(&req.process_set) else {
                out.push((
                    vec![rank],
                    error(
                        &req,
                        format!("process set {} does not exist", req.process_set),
                    ),
                ));
                continue;
            };
            let Some(&idx) = set.index.get(&rank) else {
                let msg = format!("rank {rank} is not in process set {}", req.process_set);
                out.push((vec![rank], error(&req, msg)));
                continue;
            };
            if req.kind == OpKind::Join {
                if !set.joined[idx] {
                    set.joined[idx] = true;
                    set.joins += 1;
                    if !self.shut[rank] {
                        set.excuse(idx);
                    }
                }
                set.last_joined = rank;
                continue;
            }
            if req.kind == OpKind::Shutdown && !self.shut[rank] {
                self.shut[rank] = true;
                for s in self.sets.values_mut() {
                    if let Some(&i) = s.index.get(&rank) {
                        if !s.joined[i] {
                            s.excuse(i);
                        }
                    }
                }
            }
            let Some(set) = self.sets.get_mut(&req.process_set) else {
                continue;
            };
            let n = set.members.len();
            self.seq += 1;
            let seq = self.seq;
            let (joined, members, shut) = (&set.joined, &set.members, &self.shut);
            // The name is cloned only where it is new.
            if !set.pending.contains_key(&req.name) {
                set.pending.insert(
                    req.name.clone(),
                    Pending {
                        seq,
                        reqs: vec![None; n],
                        waiting: (0..n).filter(|&i| !joined[i] && !shut[members[i]]).count(),
                        since: Instant::now(),
                        warned: false,
                    },
                );
            }
            let p = set.pending.get_mut(&req.name).expect("inserted");
            if p.reqs[idx].is_none() && !set.joined[idx] && !self.shut[rank] {
                p.waiting -= 1;
            }
            p.reqs[idx] = Some(req);
        }
        self.flush(&mut out);
        if let Some(t) = &mut self.autotune {
            if let Some(k) = t.observe(&out, Instant::now()) {
                self.fusion_threshold = k.fusion as usize;
                let live: Vec<usize> = (0..self.shut.len()).filter(|&r| !self.shut[r]).collect();
                let params = Response::Params {
                    fusion: k.fusion,
                    cycle_us: k.cycle.as_micros() as u64,
                    flat: k.flat,
                };
                out.push((live, params));
            }
            if !t.done() {
                return out;
            }
            self.autotune = None;
        }
        if let Some(d) = &mut self.offline {
            let joined = self.sets.values().any(|s| s.joins > 0);
            d.watch(&mut out, !joined);
            let quiet = !joined
                && self.forming.is_empty()
                && self.sets.values().all(|s| s.pending.is_empty());
            out.extend(d.settle(quiet));
        }
        out
    }

    /// A rank's connection broke: the job cannot go on.
    pub fn disconnect(&mut self, rank: usize, why: &str) -> Outgoing {
        if self.shut[rank] {
            // It announced its shutdown; leaving afterwards is expected.
            return Outgoing::new();
        }
        let others: Vec<usize> = (0..self.shut.len()).filter(|&r| r != rank).collect();
        let message = format!("rank {rank} is gone ({why}); the job cannot continue");
        vec![(others, Response::Abort { message })]
    }

    /// Answers every name that became ready, and completed joins.
    fn flush(&mut self, out: &mut Outgoing) {
        let size = self.shut.len();
        let mut added = Vec::new();
        let mut removed = Vec::new();
        for (&ps, set) in self.sets.iter_mut() {
            let mut ready: Vec<(u64, String)> = set
                .pending
                .iter()
                .filter(|(_, p)| p.waiting == 0)
                .map(|(n, p)| (p.seq, n.clone()))
                .collect();
            ready.sort();
            let mut answers = Vec::new();
            for (_, name) in ready {
                let p = set.pending.remove(&name).unwrap();
                let ints = p
                    .reqs
                    .iter()
                    .flatten()
                    .next()
                    .map(|r| r.ints.clone())
                    .unwrap_or_default();
                let cacheable = p.reqs.iter().all(Option::is_some)
                    && matches!(
                        p.reqs[0].as_ref().map(|r| r.kind),
                        Some(OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter)
                    );
                let first = p.reqs[0].clone();
                let mut a = decide(ps, set, &name, p.reqs, &self.shut);
                if let Response::Done { kind, value, .. } = &mut a {
                    let checked = match kind {
                        OpKind::AddProcessSet => check_ranks(&ints, size).map(|ranks| {
                            *value = self.next_set_id as i64;
                            self.next_set_id += 1;
                            added.push((*value as u32, ranks));
                        }),
                        OpKind::RemoveProcessSet => match ints.first() {
                            Some(&id) if id > 0 && id < self.next_set_id as i64 => {
                                removed.push(id as u32);
                                Ok(())
                            }
                            _ => Err(format!("process set {ints:?} cannot be removed")),
                        },
                        _ => Ok(()),
                    };
                    if let Err(message) = checked {
                        a = Response::Error {
                            process_set: ps,
                            names: vec![name.clone()],
                            message,
                        };
                    }
                }
                if cacheable
                    && matches!(a, Response::Op { .. })
                    && self.cache.len() < self.cache_capacity
                    && !self.cache_index.contains_key(&(ps, name.clone()))
                {
                    self.cache
                        .push(first.expect("cacheable requests are present"));
                    let id = self.cache.len() as u32;
                    self.cache_index.insert((ps, name.clone()), id);
                    out.push((
                        set.members.clone(),
                        Response::Cached {
                            process_set: ps,
                            name,
                            id,
                        },
                    ));
                }
                answers.push(a);
            }
            for a in fuse(answers, self.fusion_threshold) {
                out.push((set.members.clone(), a));
            }
            if set.joins == set.members.len() {
                let last = set.last_joined as i64;
                set.unjoin_all(&self.shut);
                let done = Response::Done {
                    kind: OpKind::Join,
                    process_set: ps,
                    name: "join".into(),
                    value: last,
                };
                out.push((set.members.clone(), done));
            }
        }
        for (id, ranks) in added {
            self.sets.insert(id, SetState::new(ranks));
        }
        for id in removed {
            self.sets.remove(&id);
        }
        self.form_ready(out);
    }

    /// Records `rank`'s request to form the set of the ranks in `req.ints`.
    fn ask_to_form(&mut self, rank: usize, req: &Request, out: &mut Outgoing) {
        let ranks = match check_ranks(&req.ints, self.shut.len()) {
            Ok(ranks) => ranks,
            Err(message) => return out.push((vec![rank], error(req, message))),
        };
        let Some(idx) = ranks.iter().position(|&m| m == rank) else {
            let message =
                format!("rank {rank} cannot form process set {ranks:?}: only its members form it");
            return out.push((vec![rank], error(req, message)));
        };
        let n = ranks.len();
        let f = self.forming.entry(ranks).or_insert_with(|| Forming {
            names: vec![None; n],
            since: Instant::now(),
            warned: false,
        });
        f.names[idx] = Some(req.name.clone());
    }

    /// Gives an id to each set that all its members asked to form, and fails
    /// those that a member shut down without asking for.
    fn form_ready(&mut self, out: &mut Outgoing) {
        for (ranks, f) in std::mem::take(&mut self.forming) {
            let asked = || {
                ranks
                    .iter()
                    .zip(&f.names)
                    .filter_map(|(&m, n)| Some((m, n.clone()?)))
            };
            if f.names.iter().all(Option::is_some) {
                let id = self.next_set_id;
                self.next_set_id += 1;
                for (m, name) in asked() {
                    let done = Response::Done {
                        kind: OpKind::FormProcessSet,
                        process_set: 0,
                        name,
                        value: id as i64,
                    };
                    out.push((vec![m], done));
                }
                self.sets.insert(id, SetState::new(ranks));
                continue;
            }
            let gone: Vec<usize> = (ranks.iter().zip(&f.names))
                .filter(|&(&m, n)| n.is_none() && self.shut[m])
                .map(|(&m, _)| m)
                .collect();
            if gone.is_empty() {
                self.forming.insert(ranks, f);
                continue;
            }
            for (m, name) in asked() {
                let message = format!(
                    "form_process_set of ranks {ranks:?} can never complete: rank(s) {gone:?} \
                     shut down without asking for it"
                );
                let names = vec![name];
                out.push((
                    vec![m],
                    Response::Error {
                        process_set: 0,
                        names,
                        message,
                    },
                ));
            }
        }
    }
}

impl StallLimits {
    /// Adds `what`, waiting for `waited`, to the warnings once (`warned`) when
    /// it is past the warning limit, and keeps the longest wait past the
    /// shutdown limit in `worst`.
    fn judge(
        &self,
        waited: Duration,
        what: String,
        warned: &mut bool,
        found: &mut Stalls,
        worst: &mut Option<(Duration, String)>,
    ) {
        if self.warn.is_some_and(|w| waited >= w) && !*warned {
            *warned = true;
            found.warnings.push(what.clone());
        }
        if self.fail.is_some_and(|f| waited >= f)
            && !worst.as_ref().is_some_and(|(w, _)| waited <= *w)
        {
            *worst = Some((waited, what));
        }
    }
}

/// Ascending ranks as a list whose runs of three or more are ranges: `[2]`,
/// `[0, 1]`, `[0-122, 124-999]`, so that a message about a thousand ranks stays short.
pub fn ranks_text(ranks: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        if j - i >= 2 {
            parts.push(format!("{}-{}", ranks[i], ranks[j]));
        } else {
            parts.extend(ranks[i..=j].iter().map(usize::to_string));
        }
        i = j + 1;
    }
    format!("[{}]", parts.join(", "))
}

/// Validates the member list of a new process set.
fn check_ranks(ints: &[i64], size: usize) -> Result<Vec<usize>, String> {
    let ok = !ints.is_empty()
        && ints.windows(2).all(|w| w[0] < w[1])
        && ints.iter().all(|&r| r >= 0 && (r as usize) < size);
    if ok {
        Ok(ints.iter().map(|&r| r as usize).collect())
    } else {
        Err(format!(
            "process set ranks {ints:?} must be distinct ranks from 0 to {} in increasing order",
            size - 1
        ))
    }
}

fn error(req: &Request, message: String) -> Response {
    Response::Error {
        process_set: req.process_set,
        names: vec![req.name.clone()],
        message,
    }
}

fn fmt_shape(s: &[i64]) -> String {
    format!("{s:?}")
}

/// Checks that every rank asked for the same thing and builds the answer.
fn decide(
    ps: u32,
    set: &SetState,
    name: &str,
    reqs: Vec<Option<Arc<Request>>>,
    shut: &[bool],
) -> Response {
    let fail = |message: String| Response::Error {
        process_set: ps,
        names: vec![name.into()],
        message,
    };
    let present: Vec<(usize, &Request)> = reqs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_deref().map(|r| (i, r)))
        .collect();
    let (i0, first) = present[0];
    let g = |i: usize| set.members[i];
    let gone: Vec<usize> = (0..reqs.len())
        .filter(|&i| reqs[i].is_none() && shut[set.members[i]] && !set.joined[i])
        .map(g)
        .collect();
    if !gone.is_empty() && first.kind != OpKind::Shutdown {
        return fail(format!(
            "{} '{name}' can never complete: rank(s) {gone:?} shut down without submitting it",
            first.kind.name()
        ));
    }
    // Members that sent the same cached request share it: nothing to compare.
    let differ: Vec<(usize, &Request)> = present[1..]
        .iter()
        .copied()
        .filter(|&(_, r)| !std::ptr::eq(r, first))
        .collect();
    for &(i, r) in &differ {
        if r.kind != first.kind {
            return fail(format!(
                "Mismatched operations for '{name}': rank {} requested {}, rank {} requested {}",
                g(i0),
                first.kind.name(),
                g(i),
                r.kind.name()
            ));
        }
    }
    let kind = first.kind;
    let joined: Vec<usize> = (0..reqs.len())
        .filter(|&i| reqs[i].is_none())
        .map(g)
        .collect();
    if !joined.is_empty() && kind != OpKind::Allreduce && kind != OpKind::Shutdown {
        return fail(format!(
            "{} '{name}' cannot run while rank(s) {joined:?} have joined; only allreduce \
             supports join",
            kind.name()
        ));
    }
    for &(i, r) in &differ {
        let mismatch = |what: &str, a: String, b: String| {
            fail(format!(
                "Mismatched {} {what} for '{name}': rank {} sent {a}, rank {} sent {b}",
                kind.name(),
                g(i0),
                g(i)
            ))
        };
        if kind.has_data() && r.dtype != first.dtype {
            return mismatch(
                "data types",
                first.dtype.name().into(),
                r.dtype.name().into(),
            );
        }
        if matches!(kind, OpKind::Allreduce | OpKind::Reducescatter) && r.op != first.op {
            return mismatch("reduce ops", first.op.name().into(), r.op.name().into());
        }
        if matches!(kind, OpKind::Allreduce | OpKind::Reducescatter)
            && (r.prescale != first.prescale || r.postscale != first.postscale)
        {
            return mismatch(
                "scale factors",
                format!("{}/{}", first.prescale, first.postscale),
                format!("{}/{}", r.prescale, r.postscale),
            );
        }
        if kind == OpKind::Allreduce && r.plan.on_host() != first.plan.on_host() {
            return mismatch(
                "plans (PERSEUS_ALLREDUCE_DTYPE, _GRADIENT_SCALE, _MODE)",
                first.plan.describe(),
                r.plan.describe(),
            );
        }
        if kind == OpKind::Allgather && r.plan.mode != first.plan.mode {
            return mismatch(
                "allgather modes (HOROVOD_HIERARCHICAL_ALLGATHER)",
                first.plan.mode.name().into(),
                r.plan.mode.name().into(),
            );
        }
        if kind == OpKind::Broadcast && r.root != first.root {
            return mismatch("root ranks", first.root.to_string(), r.root.to_string());
        }
        let same_shape = match kind {
            OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter => r.shape == first.shape,
            OpKind::Allgather if first.stack || r.stack => r.shape == first.shape,
            OpKind::Allgather | OpKind::Alltoall => {
                r.shape.len() == first.shape.len()
                    && !r.shape.is_empty()
                    && r.shape[1..] == first.shape[1..]
            }
            _ => true,
        };
        if !same_shape {
            let mut e = mismatch(
                "tensor shapes",
                fmt_shape(&first.shape),
                fmt_shape(&r.shape),
            );
            if kind == OpKind::Allgather && (first.stack || r.stack) {
                if let Response::Error { message, .. } = &mut e {
                    message.push_str(
                        "; allgather stacks equal shapes by default: set \
                         PERSEUS_CHANGE_HVD_ALLGATHER=1 to concatenate tensors of different \
                         first dimensions along dim 0 (Horovod behaviour)",
                    );
                }
            }
            return e;
        }
        if matches!(kind, OpKind::AddProcessSet | OpKind::RemoveProcessSet) && r.ints != first.ints
        {
            return mismatch(
                "arguments",
                format!("{:?}", first.ints),
                format!("{:?}", r.ints),
            );
        }
    }
    let n = reqs.len() as i64;
    // Device-direct only when every member sent a device tensor (none joined).
    let plan = Plan {
        device: present.len() == reqs.len() && present.iter().all(|(_, r)| r.plan.device),
        ..first.plan
    };
    let op = |sizes: Vec<i64>| Response::Op {
        kind,
        process_set: ps,
        names: vec![name.into()],
        shapes: vec![first.shape.clone()],
        dtype: first.dtype,
        op: first.op,
        root: first.root,
        prescale: first.prescale,
        postscale: first.postscale,
        sizes,
        plan,
    };
    let done = |value: i64| Response::Done {
        kind,
        process_set: ps,
        name: name.into(),
        value,
    };
    match kind {
        OpKind::Allreduce | OpKind::Reducescatter => op(vec![]),
        OpKind::Broadcast if !(0..n).contains(&first.root) => fail(format!(
            "broadcast '{name}': root {} is not a rank of the set (0 to {})",
            first.root,
            n - 1
        )),
        OpKind::Broadcast => op(vec![]),
        OpKind::Allgather => op(present.iter().map(|(_, r)| r.shape[0]).collect()),
        OpKind::Alltoall => {
            let mut m = Vec::with_capacity((n * n) as usize);
            for &(i, r) in &present {
                if r.ints.len() as i64 != n
                    || r.ints.iter().any(|&s| s < 0)
                    || r.ints.iter().sum::<i64>() != r.shape[0]
                {
                    return fail(format!(
                        "alltoall '{name}': rank {} sent splits {:?} that do not divide its {} \
                         rows among {n} ranks",
                        g(i),
                        r.ints,
                        r.shape[0]
                    ));
                }
                m.extend_from_slice(&r.ints);
            }
            op(m)
        }
        OpKind::AddProcessSet => done(-1),
        OpKind::RemoveProcessSet => done(first.ints.first().copied().unwrap_or(-1)),
        OpKind::Barrier
        | OpKind::Shutdown
        | OpKind::Join
        | OpKind::OfflineAck
        | OpKind::FormProcessSet => done(0),
    }
}

/// Most bytes of names one fused response carries, so that a response frame stays
/// small however many tiny tensors with long names fuse.
const MAX_FUSED_NAME_BYTES: usize = 1 << 20;

/// Merges runs of compatible single-tensor allreduces up to `threshold` bytes
/// of data (and [`MAX_FUSED_NAME_BYTES`] of names).
fn fuse(answers: Vec<Response>, threshold: usize) -> Vec<Response> {
    let mut out: Vec<Response> = Vec::with_capacity(answers.len());
    let mut fused_bytes = 0usize;
    let mut name_bytes = 0usize;
    for a in answers {
        if let (
            Some(Response::Op {
                kind: OpKind::Allreduce,
                names,
                shapes,
                dtype,
                op,
                prescale,
                postscale,
                plan,
                ..
            }),
            Response::Op {
                kind: OpKind::Allreduce,
                names: n2,
                shapes: s2,
                dtype: d2,
                op: o2,
                prescale: p2,
                postscale: q2,
                plan: plan2,
                ..
            },
        ) = (out.last_mut(), &a)
        {
            let bytes: usize = s2[0].iter().product::<i64>().max(0) as usize * d2.size();
            if dtype == d2
                && op == o2
                && prescale == p2
                && postscale == q2
                && plan == plan2
                && fused_bytes + bytes <= threshold
                && name_bytes + n2[0].len() <= MAX_FUSED_NAME_BYTES
            {
                names.extend(n2.iter().cloned());
                shapes.extend(s2.iter().cloned());
                fused_bytes += bytes;
                name_bytes += n2[0].len();
                continue;
            }
        }
        (fused_bytes, name_bytes) = match &a {
            Response::Op {
                shapes,
                dtype,
                names,
                ..
            } => (
                shapes[0].iter().product::<i64>().max(0) as usize * dtype.size(),
                names.iter().map(String::len).sum(),
            ),
            _ => (0, 0),
        };
        out.push(a);
    }
    out
}

#[cfg(test)]
mod tests;
