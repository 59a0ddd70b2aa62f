//! What ranks tell the coordinator (requests) and what it answers
//! (responses), with their wire encoding.

use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::hash;
use crate::plan::Plan;
use crate::wire::{Reader, Writer};

/// The kind of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// Reduce across ranks.
    Allreduce = 0,
    /// Concatenate along dim 0.
    Allgather = 1,
    /// Copy the root's tensor everywhere.
    Broadcast = 2,
    /// Exchange row blocks between every pair.
    Alltoall = 3,
    /// Reduce, then give each rank its rows.
    Reducescatter = 4,
    /// Wait for every rank.
    Barrier = 5,
    /// This rank is out of data.
    Join = 6,
    /// Register a process set (over all ranks).
    AddProcessSet = 7,
    /// Remove a process set (over all ranks).
    RemoveProcessSet = 8,
    /// This rank is leaving.
    Shutdown = 9,
    /// This rank took the coordinator's offer to run a recorded schedule
    /// (PERSEUS_OFFLINE_NEG) and now holds its new requests.
    OfflineAck = 10,
    /// Register a process set over its own members only: the others never
    /// learn of it (torch's `use_local_synchronization=True` groups).
    FormProcessSet = 11,
}

impl OpKind {
    fn from_code(c: u8) -> Result<Self> {
        use OpKind::*;
        Ok(match c {
            0 => Allreduce,
            1 => Allgather,
            2 => Broadcast,
            3 => Alltoall,
            4 => Reducescatter,
            5 => Barrier,
            6 => Join,
            7 => AddProcessSet,
            8 => RemoveProcessSet,
            9 => Shutdown,
            10 => OfflineAck,
            11 => FormProcessSet,
            _ => return Err(PerseusError::Protocol(format!("unknown op kind {c}"))),
        })
    }

    /// Lower-case name, used in auto-generated tensor names and messages.
    pub fn name(self) -> &'static str {
        use OpKind::*;
        match self {
            Allreduce => "allreduce",
            Allgather => "allgather",
            Broadcast => "broadcast",
            Alltoall => "alltoall",
            Reducescatter => "reducescatter",
            Barrier => "barrier",
            Join => "join",
            AddProcessSet => "add_process_set",
            RemoveProcessSet => "remove_process_set",
            Shutdown => "shutdown",
            OfflineAck => "offline_ack",
            FormProcessSet => "form_process_set",
        }
    }

    /// True for operations that move tensor data.
    pub fn has_data(self) -> bool {
        (self as u8) <= OpKind::Reducescatter as u8
    }
}

/// One rank's request for one named operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Operation kind.
    pub kind: OpKind,
    /// Tensor name, unique among this rank's in-flight operations of the set.
    pub name: String,
    /// Process set id (0 = all ranks).
    pub process_set: u32,
    /// Element type.
    pub dtype: DataType,
    /// Tensor shape.
    pub shape: Vec<i64>,
    /// Reduction (allreduce, reducescatter).
    pub op: ReduceOp,
    /// Root rank within the set (broadcast).
    pub root: i64,
    /// Factor applied before the reduction.
    pub prescale: f64,
    /// Factor applied after the reduction.
    pub postscale: f64,
    /// Allgather: every rank must send the same shape (results are stacked).
    pub stack: bool,
    /// Alltoall: rows for each destination; AddProcessSet and FormProcessSet:
    /// the member ranks; RemoveProcessSet: the id.
    pub ints: Vec<i64>,
    /// Allreduce: encoding on the wire and shape across hosts.
    pub plan: Plan,
}

/// Bytes of a tensor of `shape` and `dtype` (a negative dimension counts as empty).
pub fn shape_bytes(shape: &[i64], dtype: DataType) -> usize {
    shape.iter().product::<i64>().max(0) as usize * dtype.size()
}

impl Request {
    /// A request with neutral defaults for everything but kind and name.
    pub fn new(kind: OpKind, name: impl Into<String>, process_set: u32) -> Request {
        Request {
            kind,
            name: name.into(),
            process_set,
            dtype: DataType::U8,
            shape: vec![],
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            stack: false,
            ints: vec![],
            plan: Plan::default(),
        }
    }

    /// Bytes of the tensor.
    pub fn nbytes(&self) -> usize {
        shape_bytes(&self.shape, self.dtype)
    }

    /// Two 64-bit hashes of everything the request says (FNV-1a from two
    /// starting points): equal on ranks that submitted the same operation.
    pub fn fingerprint(&self) -> [u64; 2] {
        let mut w = Writer::new();
        self.encode(&mut w);
        [hash::OFFSET, hash::OFFSET.rotate_left(32)].map(|start| hash::fnv1a(start, &w.0))
    }

    fn encode(&self, w: &mut Writer) {
        w.u8(self.kind as u8)
            .str(&self.name)
            .u32(self.process_set)
            .u8(self.dtype.code());
        w.i64s(&self.shape)
            .u8(self.op as u8)
            .i64(self.root)
            .f64(self.prescale);
        w.f64(self.postscale)
            .u8(u8::from(self.stack))
            .i64s(&self.ints);
        encode_plan(w, &self.plan);
    }

    fn decode(r: &mut Reader<'_>) -> Result<Request> {
        Ok(Request {
            kind: OpKind::from_code(r.u8()?)?,
            name: r.str()?,
            process_set: r.u32()?,
            dtype: DataType::from_code(r.u8()?)?,
            shape: r.i64s()?,
            op: ReduceOp::from_code(r.u8()?).map_err(|e| PerseusError::Protocol(e.to_string()))?,
            root: r.i64()?,
            prescale: r.f64()?,
            postscale: r.f64()?,
            stack: r.u8()? != 0,
            ints: r.i64s()?,
            plan: decode_plan(r)?,
        })
    }
}

fn encode_plan(w: &mut Writer, p: &Plan) {
    let (enc, mode, device) = p.codes();
    w.u8(enc).f64(p.scale).u8(mode).u8(device);
}

fn decode_plan(r: &mut Reader<'_>) -> Result<Plan> {
    let (enc, scale, mode, device) = (r.u8()?, r.f64()?, r.u8()?, r.u8()?);
    Plan::from_codes(enc, scale, mode, device)
}

/// The coordinator's decision, sent to every member of the process set.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// Run this operation now (several names: one fused allreduce).
    Op {
        /// Kind (data-moving kinds only).
        kind: OpKind,
        /// Process set.
        process_set: u32,
        /// Tensor names, in fusion order.
        names: Vec<String>,
        /// Shape of each tensor (lets joined ranks contribute zeros).
        shapes: Vec<Vec<i64>>,
        /// Element type.
        dtype: DataType,
        /// Reduction.
        op: ReduceOp,
        /// Broadcast root within the set.
        root: i64,
        /// Prescale factor.
        prescale: f64,
        /// Postscale factor.
        postscale: f64,
        /// Allgather: dim 0 of every rank; alltoall: the n×n split matrix,
        /// row `s` holding what rank `s` sends to each rank.
        sizes: Vec<i64>,
        /// Allreduce: encoding on the wire and shape across hosts.
        plan: Plan,
    },
    /// These names failed on every rank, with this message.
    Error {
        /// Process set.
        process_set: u32,
        /// Failed names.
        names: Vec<String>,
        /// Why.
        message: String,
    },
    /// A negotiation-only operation finished (barrier, join, process sets, shutdown).
    Done {
        /// Kind.
        kind: OpKind,
        /// Process set.
        process_set: u32,
        /// Name of the request it answers.
        name: String,
        /// Join: last rank to join; AddProcessSet and FormProcessSet: the new id.
        value: i64,
    },
    /// From now on, every rank may send `id` instead of this request in full
    /// (the response cache); sent just before the name's first `Op`.
    Cached {
        /// Process set.
        process_set: u32,
        /// Tensor name.
        name: String,
        /// Cache id (never reused).
        id: u32,
    },
    /// The job cannot go on (a rank died); every pending operation fails.
    Abort {
        /// Why.
        message: String,
    },
    /// PERSEUS_OFFLINE_NEG: the last steps were identical; every rank
    /// answers with an [`OpKind::OfflineAck`] and holds its new requests
    /// until the [`Response::Switch`].
    Offline {
        /// One step as allreduce groups (`Op`s of process set 0), in order.
        groups: Vec<Response>,
    },
    /// Every rank acknowledged the offer: run the schedule from here on
    /// (`go`), or send the held requests up as usual.
    Switch {
        /// Run the schedule.
        go: bool,
        /// Names of the current step that were already negotiated, skipped
        /// in the schedule's first pass.
        skip: Vec<String>,
    },
    /// HOROVOD_AUTOTUNE chose new settings: hold requests for at most
    /// `cycle_us` from now on, and run allreduces of an automatic mode on the
    /// flat ring when `flat` (the fusion threshold is the coordinator's own).
    Params {
        /// Largest fused buffer the coordinator now forms, bytes.
        fusion: u64,
        /// Cycle time, microseconds.
        cycle_us: u64,
        /// An automatic mode means the flat ring, not the hierarchy.
        flat: bool,
    },
}

const TAG_OP: u8 = 0;
const TAG_ERROR: u8 = 1;
const TAG_DONE: u8 = 2;
const TAG_ABORT: u8 = 3;
const TAG_CACHED: u8 = 4;
const TAG_OFFLINE: u8 = 5;
const TAG_SWITCH: u8 = 6;
const TAG_PARAMS: u8 = 7;

/// A request as it travels: in full, or as a response-cache id.
#[derive(Debug, Clone, PartialEq)]
pub enum WireRequest {
    /// The whole request.
    Full(Request),
    /// A request identical to the one cached under this id.
    Cached(u32),
}

/// Longest tensor name, in bytes (UTF-8), that an operation may carry: names
/// travel in every negotiation, so they are bounded like any other field.
pub const MAX_NAME_BYTES: usize = 16 << 10;

/// Encodes `items` with `encode` as one payload or, when that would exceed `max`
/// bytes, as several (the batch halved until each part fits or holds one item),
/// in order. A batch of 40,000 long names thus goes as frames of a bounded size.
pub fn in_parts<T>(items: &[T], max: usize, encode: fn(&[T]) -> Vec<u8>) -> Vec<Vec<u8>> {
    let whole = encode(items);
    if whole.len() <= max || items.len() <= 1 {
        return vec![whole];
    }
    let (a, b) = items.split_at(items.len() / 2);
    let mut parts = in_parts(a, max, encode);
    parts.extend(in_parts(b, max, encode));
    parts
}

/// Encodes a batch of requests.
pub fn encode_requests(reqs: &[WireRequest]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(reqs.len() as u32);
    for r in reqs {
        match r {
            WireRequest::Full(r) => {
                w.u8(0);
                r.encode(&mut w);
            }
            WireRequest::Cached(id) => {
                w.u8(1).u32(*id);
            }
        }
    }
    w.0
}

/// Decodes a batch of requests.
pub fn decode_requests(buf: &[u8]) -> Result<Vec<WireRequest>> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        out.push(match r.u8()? {
            0 => WireRequest::Full(Request::decode(&mut r)?),
            1 => WireRequest::Cached(r.u32()?),
            t => return Err(PerseusError::Protocol(format!("unknown request tag {t}"))),
        });
    }
    r.finish()?;
    Ok(out)
}

/// Encodes a batch of responses.
pub fn encode_responses(resps: &[Response]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(resps.len() as u32);
    for resp in resps {
        match resp {
            Response::Op {
                kind,
                process_set,
                names,
                shapes,
                dtype,
                op,
                root,
                prescale,
                postscale,
                sizes,
                plan,
            } => {
                w.u8(TAG_OP)
                    .u8(*kind as u8)
                    .u32(*process_set)
                    .u32(names.len() as u32);
                for (n, s) in names.iter().zip(shapes) {
                    w.str(n).i64s(s);
                }
                w.u8(dtype.code())
                    .u8(*op as u8)
                    .i64(*root)
                    .f64(*prescale)
                    .f64(*postscale);
                w.i64s(sizes);
                encode_plan(&mut w, plan);
            }
            Response::Error {
                process_set,
                names,
                message,
            } => {
                w.u8(TAG_ERROR).u32(*process_set).u32(names.len() as u32);
                names.iter().for_each(|n| {
                    w.str(n);
                });
                w.str(message);
            }
            Response::Done {
                kind,
                process_set,
                name,
                value,
            } => {
                w.u8(TAG_DONE)
                    .u8(*kind as u8)
                    .u32(*process_set)
                    .str(name)
                    .i64(*value);
            }
            Response::Abort { message } => {
                w.u8(TAG_ABORT).str(message);
            }
            Response::Cached {
                process_set,
                name,
                id,
            } => {
                w.u8(TAG_CACHED).u32(*process_set).str(name).u32(*id);
            }
            Response::Offline { groups } => {
                w.u8(TAG_OFFLINE).bytes(&encode_responses(groups));
            }
            Response::Switch { go, skip } => {
                w.u8(TAG_SWITCH).u8(u8::from(*go)).u32(skip.len() as u32);
                skip.iter().for_each(|n| {
                    w.str(n);
                });
            }
            Response::Params {
                fusion,
                cycle_us,
                flat,
            } => {
                w.u8(TAG_PARAMS)
                    .u64(*fusion)
                    .u64(*cycle_us)
                    .u8(u8::from(*flat));
            }
        }
    }
    w.0
}

/// Decodes a batch of responses.
pub fn decode_responses(buf: &[u8]) -> Result<Vec<Response>> {
    decode_list(buf, true)
}

/// Decodes responses; `nest`: an offline schedule may appear (it may not
/// inside another, which bounds the recursion).
fn decode_list(buf: &[u8], nest: bool) -> Result<Vec<Response>> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        out.push(match r.u8()? {
            TAG_OP => {
                let kind = OpKind::from_code(r.u8()?)?;
                let process_set = r.u32()?;
                let k = r.u32()? as usize;
                let mut names = Vec::with_capacity(k.min(4096));
                let mut shapes = Vec::with_capacity(k.min(4096));
                for _ in 0..k {
                    names.push(r.str()?);
                    shapes.push(r.i64s()?);
                }
                Response::Op {
                    kind,
                    process_set,
                    names,
                    shapes,
                    dtype: DataType::from_code(r.u8()?)?,
                    op: ReduceOp::from_code(r.u8()?)
                        .map_err(|e| PerseusError::Protocol(e.to_string()))?,
                    root: r.i64()?,
                    prescale: r.f64()?,
                    postscale: r.f64()?,
                    sizes: r.i64s()?,
                    plan: decode_plan(&mut r)?,
                }
            }
            TAG_ERROR => {
                let process_set = r.u32()?;
                let k = r.u32()? as usize;
                let names = (0..k).map(|_| r.str()).collect::<Result<Vec<_>>>()?;
                Response::Error {
                    process_set,
                    names,
                    message: r.str()?,
                }
            }
            TAG_DONE => Response::Done {
                kind: OpKind::from_code(r.u8()?)?,
                process_set: r.u32()?,
                name: r.str()?,
                value: r.i64()?,
            },
            TAG_ABORT => Response::Abort { message: r.str()? },
            TAG_CACHED => Response::Cached {
                process_set: r.u32()?,
                name: r.str()?,
                id: r.u32()?,
            },
            TAG_OFFLINE if nest => {
                let groups = decode_list(r.bytes()?, false)?;
                if !groups.iter().all(|g| matches!(g, Response::Op { .. })) {
                    return Err(PerseusError::Protocol(
                        "an offline schedule may hold only operations".into(),
                    ));
                }
                Response::Offline { groups }
            }
            TAG_SWITCH => {
                let go = r.u8()? != 0;
                let k = r.u32()? as usize;
                let skip = (0..k).map(|_| r.str()).collect::<Result<Vec<_>>>()?;
                Response::Switch { go, skip }
            }
            TAG_PARAMS => Response::Params {
                fusion: r.u64()?,
                cycle_us: r.u64()?,
                flat: r.u8()? != 0,
            },
            t => return Err(PerseusError::Protocol(format!("unknown response tag {t}"))),
        });
    }
    r.finish()?;
    Ok(out)
}
