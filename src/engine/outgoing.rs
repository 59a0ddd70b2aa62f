//! What the coordinator sends: responses and the ranks each goes to. The coordinator
//! fills it; the offline negotiation and the autotuner watch it pass.

use super::message::Response;

/// Responses to send and to whom (global ranks), in order.
pub type Outgoing = Vec<(Vec<usize>, Response)>;
