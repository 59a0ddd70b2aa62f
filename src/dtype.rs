//! Element types the core understands, and the reduction operations on them.

use crate::error::{PerseusError, Result};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// Unsigned 8-bit integer.
    U8 = 0,
    /// Signed 8-bit integer.
    I8 = 1,
    /// Signed 32-bit integer.
    I32 = 2,
    /// Signed 64-bit integer.
    I64 = 3,
    /// IEEE half precision.
    F16 = 4,
    /// Brain floating point.
    BF16 = 5,
    /// IEEE single precision.
    F32 = 6,
    /// IEEE double precision.
    F64 = 7,
    /// Boolean, one byte per element.
    Bool = 8,
    /// Signed 16-bit integer.
    I16 = 9,
    /// Unsigned 16-bit integer.
    U16 = 10,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::U8 | DataType::I8 | DataType::Bool => 1,
            DataType::F16 | DataType::BF16 | DataType::I16 | DataType::U16 => 2,
            DataType::I32 | DataType::F32 => 4,
            DataType::I64 | DataType::F64 => 8,
        }
    }

    /// The wire code of this type.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The type for a wire code.
    pub fn from_code(code: u8) -> Result<Self> {
        Ok(match code {
            0 => DataType::U8,
            1 => DataType::I8,
            2 => DataType::I32,
            3 => DataType::I64,
            4 => DataType::F16,
            5 => DataType::BF16,
            6 => DataType::F32,
            7 => DataType::F64,
            8 => DataType::Bool,
            9 => DataType::I16,
            10 => DataType::U16,
            _ => return Err(PerseusError::Protocol(format!("unknown dtype code {code}"))),
        })
    }

    /// A user-facing name, as torch spells it.
    pub fn name(self) -> &'static str {
        match self {
            DataType::U8 => "uint8",
            DataType::I8 => "int8",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::F16 => "float16",
            DataType::BF16 => "bfloat16",
            DataType::F32 => "float32",
            DataType::F64 => "float64",
            DataType::Bool => "bool",
            DataType::I16 => "int16",
            DataType::U16 => "uint16",
        }
    }
}

/// A reduction operation, numbered as Horovod numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum, then divide by the number of ranks.
    Average = 0,
    /// Element-wise sum.
    Sum = 1,
    /// Adaptive summation (not supported).
    Adasum = 2,
    /// Element-wise minimum.
    Min = 3,
    /// Element-wise maximum.
    Max = 4,
    /// Element-wise product.
    Product = 5,
}

impl ReduceOp {
    /// The op for Horovod's integer code.
    pub fn from_code(code: u8) -> Result<Self> {
        Ok(match code {
            0 => ReduceOp::Average,
            1 => ReduceOp::Sum,
            2 => ReduceOp::Adasum,
            3 => ReduceOp::Min,
            4 => ReduceOp::Max,
            5 => ReduceOp::Product,
            _ => {
                return Err(PerseusError::InvalidArgument(format!(
                    "unknown reduce op {code}; expected 0 (Average), 1 (Sum), 3 (Min), 4 (Max) \
                     or 5 (Product)"
                )))
            }
        })
    }

    /// A user-facing name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Average => "Average",
            ReduceOp::Sum => "Sum",
            ReduceOp::Adasum => "Adasum",
            ReduceOp::Min => "Min",
            ReduceOp::Max => "Max",
            ReduceOp::Product => "Product",
        }
    }
}
