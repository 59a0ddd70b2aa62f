//! The names an engine's operations carry on the timeline, as Horovod's
//! timeline names them, so tools made for Horovod's read Perseus's.

use super::OpKind;
use crate::dtype::ReduceOp;

/// The row of tensor `name` of an operation `kind`: `<op>.<name>`, as
/// Horovod's PyTorch front-end names its tensors (`allreduce.x` for
/// `hvd.allreduce(t, name="x")`). A name that already starts with `<op>.`
/// (the automatic `allreduce.noname.3`, `barrier.1`) is the row's name as it is.
pub fn row_name(kind: OpKind, name: &str) -> String {
    let op = kind.name();
    match name.strip_prefix(op) {
        Some(rest) if rest.starts_with('.') => name.to_string(),
        _ => format!("{op}.{name}"),
    }
}

/// Horovod's name of an operation, for its top-level span: the request type in
/// capitals (`ALLREDUCE`, `ADASUM` for an allreduce with `op` Adasum,
/// `ALLGATHER`, `BROADCAST`, `ALLTOALL`, `REDUCESCATTER`, `BARRIER`, `JOIN`);
/// None for Perseus's internal kinds, which the timeline leaves out.
pub fn op_name(kind: OpKind, op: ReduceOp) -> Option<&'static str> {
    Some(match kind {
        OpKind::Allreduce if op == ReduceOp::Adasum => "ADASUM",
        OpKind::Allreduce => "ALLREDUCE",
        OpKind::Allgather => "ALLGATHER",
        OpKind::Broadcast => "BROADCAST",
        OpKind::Alltoall => "ALLTOALL",
        OpKind::Reducescatter => "REDUCESCATTER",
        OpKind::Barrier => "BARRIER",
        OpKind::Join => "JOIN",
        _ => return None,
    })
}

/// Horovod's name of the negotiation of an operation: `NEGOTIATE_` and
/// [`op_name`] (`NEGOTIATE_ALLREDUCE`, ...).
pub fn negotiate_name(kind: OpKind, op: ReduceOp) -> Option<&'static str> {
    Some(match op_name(kind, op)? {
        "ADASUM" => "NEGOTIATE_ADASUM",
        "ALLREDUCE" => "NEGOTIATE_ALLREDUCE",
        "ALLGATHER" => "NEGOTIATE_ALLGATHER",
        "BROADCAST" => "NEGOTIATE_BROADCAST",
        "ALLTOALL" => "NEGOTIATE_ALLTOALL",
        "REDUCESCATTER" => "NEGOTIATE_REDUCESCATTER",
        "BARRIER" => "NEGOTIATE_BARRIER",
        _ => "NEGOTIATE_JOIN",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_named_op_dot_name_once() {
        assert_eq!(row_name(OpKind::Allreduce, "x"), "allreduce.x");
        assert_eq!(
            row_name(OpKind::Allreduce, "allreduce.noname.3"),
            "allreduce.noname.3"
        );
        assert_eq!(
            row_name(OpKind::Allreduce, "allreducex"),
            "allreduce.allreducex"
        );
        assert_eq!(
            row_name(OpKind::Broadcast, "allreduce.w"),
            "broadcast.allreduce.w"
        );
        assert_eq!(row_name(OpKind::Barrier, "barrier.1"), "barrier.1");
        let adasum = (OpKind::Allreduce, ReduceOp::Adasum);
        assert_eq!(op_name(adasum.0, adasum.1), Some("ADASUM"));
        assert_eq!(negotiate_name(adasum.0, adasum.1), Some("NEGOTIATE_ADASUM"));
        for (kind, name) in [
            (OpKind::Allreduce, "ALLREDUCE"),
            (OpKind::Allgather, "ALLGATHER"),
            (OpKind::Broadcast, "BROADCAST"),
            (OpKind::Alltoall, "ALLTOALL"),
            (OpKind::Reducescatter, "REDUCESCATTER"),
            (OpKind::Barrier, "BARRIER"),
            (OpKind::Join, "JOIN"),
        ] {
            assert_eq!(op_name(kind, ReduceOp::Sum), Some(name));
            let negotiate = format!("NEGOTIATE_{name}");
            assert_eq!(
                negotiate_name(kind, ReduceOp::Sum),
                Some(negotiate.as_str())
            );
        }
        assert_eq!(op_name(OpKind::Shutdown, ReduceOp::Sum), None);
    }
}
