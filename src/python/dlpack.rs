//! DLPack: reading framework tensors out of capsules without consuming them,
//! and handing engine-allocated tensors back as capsules a framework adopts.

use crate::dtype::DataType;
use crate::engine::{Device, OwnedTensor, TensorView};
use crate::error::{PerseusError, Result};
use crate::kernels::pool;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};

const NAME: &CStr = c"dltensor";

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;

fn dtype_of(t: DLDataType) -> Result<DataType> {
    Ok(match (t.code, t.bits, t.lanes) {
        (0, 8, 1) => DataType::I8,
        (0, 16, 1) => DataType::I16,
        (0, 32, 1) => DataType::I32,
        (0, 64, 1) => DataType::I64,
        (1, 8, 1) => DataType::U8,
        (1, 16, 1) => DataType::U16,
        (2, 16, 1) => DataType::F16,
        (2, 32, 1) => DataType::F32,
        (2, 64, 1) => DataType::F64,
        (4, 16, 1) => DataType::BF16,
        (6, 8, 1) => DataType::Bool,
        (code, bits, lanes) => {
            let what = match code {
                0 => format!("int{bits}"),
                1 => format!("uint{bits}"),
                2 => format!("float{bits}"),
                5 => format!("complex{bits}"),
                _ => format!("DLPack type code {code} with {bits} bits"),
            };
            let lanes = if lanes == 1 {
                String::new()
            } else {
                format!(" x{lanes}")
            };
            return Err(PerseusError::UnsupportedType(format!(
                "{what}{lanes}; supported: uint8, int8, uint16, int16, int32, int64, float16, \
                 bfloat16, float32, float64, bool"
            )));
        }
    })
}

fn dl_of(d: DataType) -> DLDataType {
    let (code, bits) = match d {
        DataType::I8 => (0, 8),
        DataType::I16 => (0, 16),
        DataType::U16 => (1, 16),
        DataType::I32 => (0, 32),
        DataType::I64 => (0, 64),
        DataType::U8 => (1, 8),
        DataType::F16 => (2, 16),
        DataType::F32 => (2, 32),
        DataType::F64 => (2, 64),
        DataType::BF16 => (4, 16),
        DataType::Bool => (6, 8),
    };
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// Reads the tensor a DLPack capsule describes. The capsule is not consumed:
/// the caller keeps it (and the tensor) alive until the operation completes.
pub fn view(obj: &Bound<'_, PyAny>) -> Result<TensorView> {
    let (mut v, shape) = read(obj)?;
    v.shape = shape.to_vec();
    Ok(v)
}

/// Like [`view`], for callers that treat every tensor as flat (the fused optimizers):
/// the shape is left empty, which spares an allocation per tensor.
pub fn view_flat(obj: &Bound<'_, PyAny>) -> Result<TensorView> {
    read(obj).map(|(v, _)| v)
}

/// The tensor a capsule describes (its shape left empty), and its shape.
fn read<'a>(obj: &'a Bound<'_, PyAny>) -> Result<(TensorView, &'a [i64])> {
    // SAFETY: capsule API on a live object; the pointer is checked for validity.
    let m = unsafe {
        if ffi::PyCapsule_IsValid(obj.as_ptr(), NAME.as_ptr()) != 1 {
            return Err(PerseusError::InvalidArgument(
                "expected an unconsumed DLPack capsule (tensor.__dlpack__())".into(),
            ));
        }
        &*(ffi::PyCapsule_GetPointer(obj.as_ptr(), NAME.as_ptr()) as *const DLManagedTensor)
    };
    let t = &m.dl_tensor;
    let device = match t.device.device_type {
        KDL_CPU => Device::Cpu,
        KDL_CUDA => Device::Cuda(t.device.device_id),
        other => {
            return Err(PerseusError::InvalidArgument(format!(
                "tensors on DLPack device type {other} are not supported"
            )))
        }
    };
    let dtype = dtype_of(t.dtype)?;
    let ndim = t.ndim.max(0) as usize;
    // SAFETY: DLPack guarantees `shape` (and `strides` when not null) hold `ndim`
    // entries, alive as long as the capsule (which `obj` holds).
    let shape: &'a [i64] = if ndim == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    if !t.strides.is_null() && ndim > 0 {
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut want = 1i64;
        for d in (0..ndim).rev() {
            if shape[d] != 1 && strides[d] != want {
                return Err(PerseusError::InvalidArgument(
                    "tensor is not contiguous; call .contiguous() first".into(),
                ));
            }
            want *= shape[d];
        }
    }
    let count = shape.iter().product::<i64>().max(0) as usize;
    // SAFETY: data + byte_offset is the first element per DLPack.
    let ptr = unsafe { (t.data as *mut u8).add(t.byte_offset as usize) };
    let v = TensorView {
        ptr,
        nbytes: count * dtype.size(),
        dtype,
        shape: Vec::new(),
        device,
    };
    Ok((v, shape))
}

struct Holder {
    tensor: OwnedTensor,
    managed: DLManagedTensor,
}

unsafe extern "C" fn delete_holder(m: *mut DLManagedTensor) {
    // SAFETY: manager_ctx is the Box<Holder> leaked in `capsule`.
    let h = Box::from_raw((*m).manager_ctx as *mut Holder);
    // The memory stays faulted in for the next output of its size.
    pool::give(h.tensor.buf);
}

/// A new contiguous host tensor shaped and typed like the one capsule `like`
/// describes, as a capsule. Its memory comes from the output pool (its contents are
/// unspecified): the out-of-place operations' outputs, which the caller fills.
/// A device tensor's capsule is refused: the pool is host memory.
pub fn empty_like(py: Python<'_>, like: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let v = view(like).map_err(super::errors::to_py)?;
    if v.device != Device::Cpu {
        return Err(super::errors::to_py(PerseusError::InvalidArgument(
            "empty_like: the output pool holds host memory only".into(),
        )));
    }
    let tensor = OwnedTensor {
        buf: pool::take(v.nbytes),
        dtype: v.dtype,
        shape: v.shape,
    };
    capsule(py, tensor)
}

/// Copies the host tensor capsule `src` describes into the one `dst` describes
/// (equal sizes, no overlap), without the GIL; a result of
/// [`kernels::STREAM_FROM`](crate::kernels::STREAM_FROM) bytes or more is
/// written past the cache. The out-of-place broadcast's root copies its input
/// into its new output this way while the engine sends the input.
pub fn copy_into(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let (d, s) = (
        view(dst).map_err(super::errors::to_py)?,
        view(src).map_err(super::errors::to_py)?,
    );
    let refuse = |why: String| Err(super::errors::to_py(PerseusError::InvalidArgument(why)));
    if d.device != Device::Cpu || s.device != Device::Cpu {
        return refuse("copy_into: host tensors only".into());
    }
    if d.nbytes != s.nbytes {
        return refuse(format!(
            "copy_into: {} bytes into {} bytes",
            s.nbytes, d.nbytes
        ));
    }
    let (dp, sp, n) = (d.ptr as usize, s.ptr as usize, d.nbytes);
    if n > 0 && dp < sp + n && sp < dp + n {
        return refuse("copy_into: the tensors overlap".into());
    }
    py.detach(|| {
        // SAFETY: both capsules' tensors are alive while the caller holds them
        // (it does, through this call), host memory of `n` bytes each, disjoint.
        let (dst, src) = unsafe {
            (
                std::slice::from_raw_parts_mut(dp as *mut u8, n),
                std::slice::from_raw_parts(sp as *const u8, n),
            )
        };
        crate::kernels::copy_result(dst, src);
    });
    Ok(())
}

unsafe extern "C" fn capsule_destructor(cap: *mut ffi::PyObject) {
    // A consumer renames the capsule ("used_dltensor") and owns the deleter;
    // an unconsumed one is freed here.
    if ffi::PyCapsule_IsValid(cap, NAME.as_ptr()) == 1 {
        let m = ffi::PyCapsule_GetPointer(cap, NAME.as_ptr()) as *mut DLManagedTensor;
        if let Some(d) = (*m).deleter {
            d(m);
        }
    }
}

/// Wraps an engine-allocated tensor in a DLPack capsule (zero copy).
pub fn capsule(py: Python<'_>, tensor: OwnedTensor) -> PyResult<Py<PyAny>> {
    let mut h = Box::new(Holder {
        tensor,
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: std::ptr::null_mut(),
                device: DLDevice {
                    device_type: KDL_CPU,
                    device_id: 0,
                },
                ndim: 0,
                dtype: DLDataType {
                    code: 0,
                    bits: 0,
                    lanes: 0,
                },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_holder),
        },
    });
    let t = &mut h.managed.dl_tensor;
    t.data = h.tensor.buf.as_mut_ptr().cast();
    t.ndim = h.tensor.shape.len() as i32;
    t.dtype = dl_of(h.tensor.dtype);
    t.shape = h.tensor.shape.as_mut_ptr();
    let raw = Box::into_raw(h);
    // SAFETY: `raw` stays valid until the deleter runs; the capsule points at its DLManagedTensor.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let m = std::ptr::addr_of_mut!((*raw).managed);
        let cap = ffi::PyCapsule_New(m.cast(), NAME.as_ptr(), Some(capsule_destructor));
        if cap.is_null() {
            delete_holder(m);
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, cap).unbind())
    }
}
