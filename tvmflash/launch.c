/* A checked kernel launch in C (tvmflash/launch.py compiles and loads this as a CPython module).
 *
 * A repeated call (a model's layers, token after token) runs a compiled kernel whose arguments
 * were checked at its first call. In Python, what remains per call (matching the tensors, the
 * output's torch.empty, tvm-ffi's argument packing) is cheap while the interpreter's data is in
 * cache, and costs 30-60 us where a model's weights have just evicted it: between a model's
 * products, where every attention call runs. A Launch does that part in one C call:
 *
 *   launch = Launch(function, template, inputs, outputs, team, refuse_grad)
 *   outs = launch(*tensors)       # the outputs (one, or a tuple), or None: not this launch's call
 *
 * - inputs: one (example tensor, free sizes, free strides[, heads first]) per positional
 *   argument, the masks bit masks of the kernel's dimensions; a call's tensor matches if it is a
 *   torch.Tensor (exactly: no subclass, which a mode or a tracer may stand behind), on the CPU,
 *   and has the example's dtype, rank, sizes (a free one at least ``set_min_size``'s) and
 *   strides but the free ones. "Heads first": the tensor comes as (batch, heads, seqlen,
 *   head_dim) and the kernel reads it as its transpose (batch, seqlen, heads, head_dim), as
 *   transformers' attention functions get q, k, v: no transposed view is made;
 * - outputs: example tensors whose dtype and shape each call allocates (torch's allocator,
 *   contiguous), or (example, heads first[, zeroed]): heads first, allocated as a heads-first
 *   example, (batch, heads, seqlen, head_dim), and written by the kernel through its transpose
 *   (the gradients of heads-first inputs, in their layout); zeroed, filled with zeros before the
 *   kernel runs (for kernels that write only some rows);
 * - template: the kernel's arguments in order: ("in", i), ("out", j), ("tensor", t) (held for
 *   the launch: tables, scratch), ("int", n), ("float", x); ``set(k, value)`` replaces entry k;
 * - team: at most this many threads (the thread shim's limit; 0: none); refuse_grad: None
 *   where grad mode is on and an input requires grad (autograd must record the call);
 * - set_guards(((d, key, value), ...)): None unless each d[key] (None if missing) equals its
 *   value: what else chose the kernel (the steering environment variables in os.environ's own
 *   dict, the tuning records' generation), read per call as the Python memo keys read them.
 *
 * - accepts(*tensors): whether the guards hold and the tensors match (free sizes at any length:
 *   the caller plans new tables for them).
 *
 * Anything that does not match, and any error the kernel's own argument checks raise, returns
 * None (the caller's full path then checks again and names the problem); nothing is written
 * then. The tensors are read through torch's DLPack C exchange table (no Python object is made
 * per tensor) and passed to the kernel as DLTensor pointers through tvm-ffi's C ABI. The kernel
 * runs without the GIL (as tvm-ffi's calls): a Launch belongs to one thread (its callers keep
 * one per thread), as ``set`` would release a tensor that a kernel on another thread reads.
 *
 * The module also has meta_key(*tensors) and eager_state(conditions, *tensors): what the
 * Python memo keys and checks before a repeated call read, in one C call each.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

#define MAX_ARGS 32
#define MAX_TENSORS 16
#define MAX_DIMS 8

enum { ARG_INPUT, ARG_OUTPUT, ARG_TENSOR, ARG_INT, ARG_FLOAT };

typedef int (*FunctionCall)(TVMFFIObjectHandle, TVMFFIAny*, int32_t, TVMFFIAny*);
typedef void (*ErrorMoveFromRaised)(TVMFFIObjectHandle*);
typedef int (*ObjectDecRef)(TVMFFIObjectHandle);
typedef void (*ThreadsLimit)(int);
typedef PyObject* (*Getter)(PyObject*, void*);

/* set once by init() */
static const DLPackExchangeAPI* api;
static PyTypeObject* tensor_type;
static FunctionCall function_call;
static ErrorMoveFromRaised error_move_from_raised;
static ObjectDecRef object_dec_ref;
static ThreadsLimit threads_limit; /* the thread shim's (NULL: no shim; kernels on TVM's own pool) */
static Getter requires_grad_get;   /* torch.Tensor.requires_grad's C getter */
static void* requires_grad_closure;
static PyObject* is_grad_enabled;  /* torch.is_grad_enabled */

typedef struct {
  int ndim;
  DLDataType dtype;
  int64_t shape[MAX_DIMS], strides[MAX_DIMS];
  int64_t min_size[MAX_DIMS]; /* a free size's least value (the tables' keys must lie inside) */
  unsigned free_sizes, free_strides; /* bit d: dimension d's size (stride) may differ */
  int heads_first; /* it comes as (batch, heads, seqlen, head_dim): the kernel's view swaps 1 and 2 */
} Expected;

/* ``t`` with dimensions 1 and 2 swapped (a transpose without a tensor): its shape and strides
 * copied into ``dims`` (2 x MAX_DIMS); 1 where ``t`` is no strided 4-d tensor. */
static int swap_heads(DLTensor* t, int64_t* dims) {
  if (t->ndim != 4 || t->strides == NULL) return 1;
  for (int d = 0; d < 4; d++) {
    int from = d == 1 ? 2 : d == 2 ? 1 : d;
    dims[d] = t->shape[from];
    dims[MAX_DIMS + d] = t->strides[from];
  }
  t->shape = dims;
  t->strides = dims + MAX_DIMS;
  return 0;
}

/* ``t`` as the kernel reads it: a heads-first tensor swapped (``swap_heads``). */
static int kernel_view(PyObject* tensor, int heads_first, DLTensor* t, int64_t* dims) {
  if (api->dltensor_from_py_object_no_sync(tensor, t) != 0) return -1;
  return heads_first ? swap_heads(t, dims) : 0;
}

typedef struct {
  int kind, index;
  int64_t v_int;
  double v_float;
  DLTensor tensor; /* ARG_TENSOR: the held tensor's view */
  PyObject* held;  /* ARG_TENSOR: keeps it alive */
} Arg;

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* function; /* the tvm_ffi.Function (alive as long as its handle is used) */
  PyObject* guards;   /* a tuple of (dict, key, value): what else decided the kernel (set_guards) */
  TVMFFIObjectHandle handle;
  int n_inputs, n_outputs, n_args, team, refuse_grad;
  Expected inputs[MAX_TENSORS];
  DLTensor outputs[MAX_TENSORS];
  int64_t output_shapes[MAX_TENSORS][MAX_DIMS];
  int output_heads_first[MAX_TENSORS]; /* allocated (batch, heads, seqlen, head_dim), the kernel's view swapped */
  int output_zeroed[MAX_TENSORS];      /* filled with zeros before the kernel writes (part of) it */
  Arg args[MAX_ARGS];
} Launch;

static void set_alloc_error(void* ctx, const char* kind, const char* message) {
  (void)ctx;
  PyErr_Format(PyExc_RuntimeError, "%s: %s", kind, message);
}

static int view_of(PyObject* tensor, DLTensor* out) {
  if (Py_TYPE(tensor) != tensor_type) {
    PyErr_SetString(PyExc_TypeError, "Launch takes torch.Tensor arguments");
    return -1;
  }
  return api->dltensor_from_py_object_no_sync(tensor, out);
}

static int matches(const Expected* e, const DLTensor* t) {
  if (t->ndim != e->ndim || t->device.device_type != kDLCPU || t->dtype.code != e->dtype.code ||
      t->dtype.bits != e->dtype.bits || t->dtype.lanes != e->dtype.lanes)
    return 0;
  for (int d = 0; d < e->ndim; d++) {
    if (e->free_sizes & (1u << d) ? t->shape[d] < e->min_size[d] : t->shape[d] != e->shape[d]) return 0;
    /* (a size-1 dimension's stride is never read) */
    if (!(e->free_strides & (1u << d)) && t->shape[d] != 1 && (t->strides ? t->strides[d] : -1) != e->strides[d])
      return 0;
  }
  return 1;
}

/* Parse a template entry into ``arg`` (its old tensor released); on an error ``arg`` is kept. */
static int set_arg(Arg* arg, PyObject* entry, int n_inputs, int n_outputs) {
  const char* kind;
  PyObject* value;
  Arg parsed = {0};
  if (!PyArg_ParseTuple(entry, "sO", &kind, &value)) return -1;
  if (!strcmp(kind, "in") || !strcmp(kind, "out")) {
    int input = kind[0] == 'i';
    long index = PyLong_AsLong(value);
    if (index < 0 || index >= (input ? n_inputs : n_outputs)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Launch template: index out of range");
      return -1;
    }
    parsed.kind = input ? ARG_INPUT : ARG_OUTPUT;
    parsed.index = (int)index;
  } else if (!strcmp(kind, "tensor")) {
    if (view_of(value, &parsed.tensor) != 0) return -1;
    if (parsed.tensor.device.device_type != kDLCPU) {
      PyErr_SetString(PyExc_ValueError, "Launch template: held tensors must be on the CPU");
      return -1;
    }
    parsed.kind = ARG_TENSOR;
    Py_INCREF(value);
    parsed.held = value;
  } else if (!strcmp(kind, "int")) {
    parsed.v_int = PyLong_AsLongLong(value);
    if (parsed.v_int == -1 && PyErr_Occurred()) return -1;
    parsed.kind = ARG_INT;
  } else if (!strcmp(kind, "float")) {
    parsed.v_float = PyFloat_AsDouble(value);
    if (parsed.v_float == -1.0 && PyErr_Occurred()) return -1;
    parsed.kind = ARG_FLOAT;
  } else {
    PyErr_Format(PyExc_ValueError, "Launch template: unknown kind %s", kind);
    return -1;
  }
  PyObject* old = arg->held;
  *arg = parsed;
  Py_XDECREF(old);
  return 0;
}

static void launch_dealloc(Launch* self) {
  for (int i = 0; i < self->n_args; i++) Py_CLEAR(self->args[i].held);
  Py_CLEAR(self->function);
  Py_CLEAR(self->guards);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

static int launch_init(Launch* self, PyObject* args, PyObject* kwargs) {
  PyObject *function, *template, *inputs, *outputs;
  int team, refuse_grad;
  static char* names[] = {"function", "template", "inputs", "outputs", "team", "refuse_grad", NULL};
  if (api == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "launch.init() was not called");
    return -1;
  }
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!ip", names, &function, &PyTuple_Type, &template,
                                   &PyTuple_Type, &inputs, &PyTuple_Type, &outputs, &team, &refuse_grad))
    return -1;
  if (PyTuple_GET_SIZE(template) > MAX_ARGS || PyTuple_GET_SIZE(inputs) > MAX_TENSORS ||
      PyTuple_GET_SIZE(outputs) > MAX_TENSORS) {
    PyErr_SetString(PyExc_ValueError, "Launch: too many arguments");
    return -1;
  }
  PyObject* chandle = PyObject_CallMethod(function, "__chandle__", NULL);
  if (chandle == NULL) return -1;
  self->handle = PyLong_AsVoidPtr(chandle);
  Py_DECREF(chandle);
  if (self->handle == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Launch: a null function");
    return -1;
  }
  Py_INCREF(function);
  Py_XSETREF(self->function, function);
  self->n_inputs = (int)PyTuple_GET_SIZE(inputs);
  for (int i = 0; i < self->n_inputs; i++) {  /* (example, free sizes, free strides[, heads first]) */
    PyObject* example;
    unsigned long free_sizes, free_strides;
    int heads_first = 0;
    DLTensor view;
    int64_t dims[2 * MAX_DIMS];
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(inputs, i), "Okk|p", &example, &free_sizes, &free_strides, &heads_first))
      return -1;
    if (Py_TYPE(example) != tensor_type) {
      PyErr_SetString(PyExc_TypeError, "Launch takes torch.Tensor arguments");
      return -1;
    }
    int viewed = kernel_view(example, heads_first, &view, dims);
    if (viewed != 0) {
      if (viewed > 0) PyErr_SetString(PyExc_ValueError, "Launch: a heads-first input must be a strided 4-d tensor");
      return -1;
    }
    Expected* e = &self->inputs[i];
    e->heads_first = heads_first;
    if (view.ndim > MAX_DIMS) {
      PyErr_SetString(PyExc_ValueError, "Launch: too many dimensions");
      return -1;
    }
    e->ndim = view.ndim;
    e->dtype = view.dtype;
    e->free_sizes = (unsigned)free_sizes;
    e->free_strides = (unsigned)free_strides;
    for (int d = 0; d < view.ndim; d++) {
      e->shape[d] = view.shape[d];
      e->strides[d] = view.strides ? view.strides[d] : -1;
      e->min_size[d] = 0;
    }
  }
  self->n_outputs = (int)PyTuple_GET_SIZE(outputs);
  for (int j = 0; j < self->n_outputs; j++) {  /* (example) or (example, heads first[, zeroed]) */
    DLTensor view;
    PyObject* example = PyTuple_GET_ITEM(outputs, j);
    int heads_first = 0, zeroed = 0;
    if (PyTuple_Check(example) && !PyArg_ParseTuple(example, "Op|p", &example, &heads_first, &zeroed)) return -1;
    if (view_of(example, &view) != 0) return -1;
    if (view.ndim > MAX_DIMS || (heads_first && view.ndim != 4)) {
      PyErr_SetString(PyExc_ValueError, heads_first ? "Launch: a heads-first output must be 4-d"
                                                    : "Launch: too many dimensions");
      return -1;
    }
    self->output_heads_first[j] = heads_first;
    self->output_zeroed[j] = zeroed;
    for (int d = 0; d < view.ndim; d++) self->output_shapes[j][d] = view.shape[d];
    self->outputs[j] = view;
    self->outputs[j].shape = self->output_shapes[j];
    self->outputs[j].strides = NULL;
    self->outputs[j].data = NULL;
    self->outputs[j].byte_offset = 0;
  }
  for (int i = 0; i < self->n_args; i++) Py_CLEAR(self->args[i].held);
  self->n_args = (int)PyTuple_GET_SIZE(template);
  for (int i = 0; i < self->n_args; i++) {
    self->args[i].held = NULL;
    if (set_arg(&self->args[i], PyTuple_GET_ITEM(template, i), self->n_inputs, self->n_outputs) != 0) return -1;
  }
  self->team = team;
  self->refuse_grad = refuse_grad;
  return 0;
}

/* Whether every guard holds: dict[key] equals value (a missing key reads as None). */
static int guards_hold(PyObject* guards) {
  if (guards == NULL) return 1;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guards); i++) {
    PyObject* guard = PyTuple_GET_ITEM(guards, i);
    PyObject* found = PyDict_GetItemWithError(PyTuple_GET_ITEM(guard, 0), PyTuple_GET_ITEM(guard, 1));
    PyObject* value = PyTuple_GET_ITEM(guard, 2);
    if (found == NULL) {
      if (PyErr_Occurred()) return -1;
      found = Py_None;
    }
    if (found != value) {
      int equal = PyObject_RichCompareBool(found, value, Py_EQ);
      if (equal <= 0) return equal;
    }
  }
  return 1;
}

/* 1 if the guards hold and ``tensors`` are the launch's inputs (their kernel views left in
 * ``views``, in ``dims`` where transposed), 0 if not, -1 on an error; ``any_length``: a free size
 * at any length (``min_size`` not read). */
static int call_matches(Launch* self, PyObject* const* tensors, Py_ssize_t n, DLTensor* views,
                        int64_t (*dims)[2 * MAX_DIMS], int any_length) {
  if (n != self->n_inputs) return 0;
  int hold = guards_hold(self->guards);
  if (hold <= 0) return hold;
  for (Py_ssize_t i = 0; i < n; i++) {
    if (Py_TYPE(tensors[i]) != tensor_type) return 0;
    int viewed = kernel_view(tensors[i], self->inputs[i].heads_first, &views[i], dims[i]);
    if (viewed != 0) {
      if (viewed < 0) PyErr_Clear();
      return 0;
    }
    const Expected* expected = &self->inputs[i];
    Expected loose;
    if (any_length) {
      loose = *expected;
      memset(loose.min_size, 0, sizeof(loose.min_size));
      expected = &loose;
    }
    if (!matches(expected, &views[i])) return 0;
  }
  return 1;
}

static int records_grad(PyObject* const* tensors, Py_ssize_t n) {
  PyObject* enabled = PyObject_CallNoArgs(is_grad_enabled);
  if (enabled == NULL) return -1;
  int on = enabled == Py_True;
  Py_DECREF(enabled);
  if (!on) return 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* flag = requires_grad_get(tensors[i], requires_grad_closure);
    if (flag == NULL) return -1;
    int requires = flag == Py_True;
    Py_DECREF(flag);
    if (requires) return 1;
  }
  return 0;
}

static PyObject* launch_call(Launch* self, PyObject* const* tensors, size_t nargsf, PyObject* kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  DLTensor views[MAX_TENSORS], out_views[MAX_TENSORS];
  int64_t dims[MAX_TENSORS][2 * MAX_DIMS], out_dims[MAX_TENSORS][2 * MAX_DIMS];
  PyObject* outs[MAX_TENSORS] = {NULL};
  TVMFFIAny packed[MAX_ARGS];
  if (kwnames && PyTuple_GET_SIZE(kwnames)) Py_RETURN_NONE;
  int match = call_matches(self, tensors, n, views, dims, 0);
  if (match < 0) return NULL;
  if (!match) Py_RETURN_NONE;
  if (self->refuse_grad) {
    int grad = records_grad(tensors, n);
    if (grad < 0) return NULL;
    if (grad) Py_RETURN_NONE;
  }
  for (int j = 0; j < self->n_outputs; j++) {
    DLManagedTensorVersioned* managed;
    void* obj;
    if (api->managed_tensor_allocator(&self->outputs[j], &managed, NULL, set_alloc_error) != 0) goto fail;
    if (api->managed_tensor_to_py_object_no_sync(managed, &obj) != 0) goto fail;
    outs[j] = (PyObject*)obj;
    if (api->dltensor_from_py_object_no_sync(obj, &out_views[j]) != 0) goto fail;
    if (self->output_zeroed[j]) { /* (allocated contiguous: its elements are one block) */
      size_t bytes = ((size_t)out_views[j].dtype.bits * out_views[j].dtype.lanes + 7) / 8;
      for (int d = 0; d < out_views[j].ndim; d++) bytes *= (size_t)out_views[j].shape[d];
      memset((char*)out_views[j].data + out_views[j].byte_offset, 0, bytes);
    }
    if (self->output_heads_first[j] && swap_heads(&out_views[j], out_dims[j]) != 0) {
      PyErr_SetString(PyExc_RuntimeError, "Launch: an allocated output has no strides");
      goto fail;
    }
  }
  for (int i = 0; i < self->n_args; i++) {
    const Arg* arg = &self->args[i];
    TVMFFIAny* any = &packed[i];
    any->zero_padding = 0;
    any->v_int64 = 0;
    switch (arg->kind) {
      case ARG_INPUT: any->type_index = kTVMFFIDLTensorPtr; any->v_ptr = &views[arg->index]; break;
      case ARG_OUTPUT: any->type_index = kTVMFFIDLTensorPtr; any->v_ptr = &out_views[arg->index]; break;
      case ARG_TENSOR: any->type_index = kTVMFFIDLTensorPtr; any->v_ptr = (void*)&arg->tensor; break;
      case ARG_INT: any->type_index = kTVMFFIInt; any->v_int64 = arg->v_int; break;
      default: any->type_index = kTVMFFIFloat; any->v_float64 = arg->v_float; break;
    }
  }
  if (threads_limit != NULL) threads_limit(self->team);
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int failed;
  Py_BEGIN_ALLOW_THREADS  /* (as tvm-ffi's own calls: the kernel runs without the GIL) */
  failed = function_call(self->handle, packed, self->n_args, &result);
  Py_END_ALLOW_THREADS
  if (failed) { /* the kernel's argument checks refused: the caller's full path names why */
    TVMFFIObjectHandle error = NULL;
    error_move_from_raised(&error);
    if (error != NULL) object_dec_ref(error);
    for (int j = 0; j < self->n_outputs; j++) Py_CLEAR(outs[j]);
    Py_RETURN_NONE;
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != NULL) object_dec_ref(result.v_obj);
  if (self->n_outputs == 1) return outs[0];
  PyObject* tuple = PyTuple_New(self->n_outputs);
  if (tuple == NULL) goto fail;
  for (int j = 0; j < self->n_outputs; j++) PyTuple_SET_ITEM(tuple, j, outs[j]);
  return tuple;
fail:
  for (int j = 0; j < self->n_outputs; j++) Py_CLEAR(outs[j]);
  return NULL;
}

static PyObject* launch_accepts(Launch* self, PyObject* const* tensors, Py_ssize_t n) {
  DLTensor views[MAX_TENSORS];
  int64_t dims[MAX_TENSORS][2 * MAX_DIMS];
  int match = call_matches(self, tensors, n, views, dims, 1); /* (the tables may be planned anew) */
  if (match < 0) return NULL;
  return PyBool_FromLong(match);
}

static PyObject* launch_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  return launch_call((Launch*)self, args, nargsf, kwnames);
}

static PyObject* launch_tp_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  return launch_call((Launch*)self, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), NULL);
}

static PyObject* launch_set(Launch* self, PyObject* args) {
  int index;
  PyObject* entry;
  if (!PyArg_ParseTuple(args, "iO!", &index, &PyTuple_Type, &entry)) return NULL;
  if (index < 0 || index >= self->n_args) {
    PyErr_SetString(PyExc_IndexError, "Launch.set: no such argument");
    return NULL;
  }
  if (set_arg(&self->args[index], entry, self->n_inputs, self->n_outputs) != 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject* launch_set_team(Launch* self, PyObject* value) {
  long team = PyLong_AsLong(value);
  if (team == -1 && PyErr_Occurred()) return NULL;
  self->team = (int)team;
  Py_RETURN_NONE;
}

static PyObject* launch_set_min_size(Launch* self, PyObject* args) {
  int input, dim;
  long long size;
  if (!PyArg_ParseTuple(args, "iiL", &input, &dim, &size)) return NULL;
  if (input < 0 || input >= self->n_inputs || dim < 0 || dim >= self->inputs[input].ndim) {
    PyErr_SetString(PyExc_IndexError, "Launch.set_min_size: no such input dimension");
    return NULL;
  }
  self->inputs[input].min_size[dim] = size;
  Py_RETURN_NONE;
}

static PyObject* launch_set_guards(Launch* self, PyObject* guards) {
  if (!PyTuple_Check(guards)) {
    PyErr_SetString(PyExc_TypeError, "Launch.set_guards takes a tuple of (dict, key, value)");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(guards); i++) {
    PyObject* guard = PyTuple_GET_ITEM(guards, i);
    if (!PyTuple_Check(guard) || PyTuple_GET_SIZE(guard) != 3 || !PyDict_Check(PyTuple_GET_ITEM(guard, 0))) {
      PyErr_SetString(PyExc_TypeError, "Launch.set_guards takes a tuple of (dict, key, value)");
      return NULL;
    }
  }
  Py_INCREF(guards);
  Py_XSETREF(self->guards, guards);
  Py_RETURN_NONE;
}

static PyMethodDef launch_methods[] = {
    {"accepts", (PyCFunction)(void (*)(void))launch_accepts, METH_FASTCALL,
     "accepts(*tensors): whether calls with these tensors are this launch's (free sizes at any length)"},
    {"set_guards", (PyCFunction)launch_set_guards, METH_O,
     "set_guards(((dict, key, value), ...)): calls run only while each dict[key] equals its value"},
    {"set_min_size", (PyCFunction)launch_set_min_size, METH_VARARGS,
     "set_min_size(i, d, n): input i's free dimension d must be at least n"},
    {"set", (PyCFunction)launch_set, METH_VARARGS, "set(k, (kind, value)): replace the template's entry k"},
    {"set_team", (PyCFunction)launch_set_team, METH_O, "set_team(n): at most n threads"},
    {NULL, NULL, 0, NULL}};

static PyObject* launch_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* self = PyType_GenericNew(type, args, kwargs);
  if (self != NULL) ((Launch*)self)->vectorcall = launch_vectorcall;
  return self;
}

static PyTypeObject LaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tvmflash_launch.Launch",
    .tp_basicsize = sizeof(Launch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = launch_new,
    .tp_init = (initproc)launch_init,
    .tp_dealloc = (destructor)launch_dealloc,
    .tp_call = launch_tp_call,
    .tp_vectorcall_offset = offsetof(Launch, vectorcall),
    .tp_methods = launch_methods,
    .tp_doc = "A checked kernel launch: launch(*tensors) -> outputs, or None where the call is not this launch's",
};

/* meta_key(*tensors): a hashable tuple of what the checks of a call read from its tensors but
 * their values (dtype, device, shape and strides of each), or None where a tensor is no plain
 * torch.Tensor or has no strided DLPack view: one C call where Python reads 12 attributes. */
static PyObject* meta_key(PyObject* module, PyObject* const* tensors, Py_ssize_t n) {
  Py_ssize_t size = 0;
  DLTensor views[MAX_TENSORS];
  if (api == NULL || n > MAX_TENSORS) Py_RETURN_NONE;
  for (Py_ssize_t i = 0; i < n; i++) {
    if (Py_TYPE(tensors[i]) != tensor_type) Py_RETURN_NONE;
    if (api->dltensor_from_py_object_no_sync(tensors[i], &views[i]) != 0) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    if (views[i].strides == NULL && views[i].ndim > 0) Py_RETURN_NONE;
    size += 5 + 2 * views[i].ndim;
  }
  PyObject* key = PyTuple_New(size);
  if (key == NULL) return NULL;
  Py_ssize_t at = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    const DLTensor* t = &views[i];
    long long head[5] = {t->dtype.code | (t->dtype.bits << 8) | ((long long)t->dtype.lanes << 16),
                         t->device.device_type, t->device.device_id, t->ndim, (long long)t->byte_offset};
    for (int j = 0; j < 5; j++) PyTuple_SET_ITEM(key, at++, PyLong_FromLongLong(head[j]));
    for (int d = 0; d < t->ndim; d++) PyTuple_SET_ITEM(key, at++, PyLong_FromLongLong(t->shape[d]));
    for (int d = 0; d < t->ndim; d++) PyTuple_SET_ITEM(key, at++, PyLong_FromLongLong(t->strides[d]));
  }
  for (Py_ssize_t j = 0; j < size; j++) {
    if (PyTuple_GET_ITEM(key, j) == NULL) {
      Py_DECREF(key);
      return NULL;
    }
  }
  return key;
}

/* eager_state(conditions, *tensors): 2 unless every (callable, args, value) of ``conditions``
 * holds (callable(*args) == value: no autocast, mode or transform that must see the call), else
 * 1 if autograd records a call of these tensors, else 0. */
static PyObject* eager_state(PyObject* module, PyObject* const* args, Py_ssize_t n) {
  if (n < 1 || !PyTuple_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "eager_state(conditions, *tensors)");
    return NULL;
  }
  PyObject* conditions = args[0];
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(conditions); i++) {
    PyObject* condition = PyTuple_GET_ITEM(conditions, i);
    if (!PyTuple_Check(condition) || PyTuple_GET_SIZE(condition) != 3) {
      PyErr_SetString(PyExc_TypeError, "eager_state: conditions are (callable, args, value)");
      return NULL;
    }
    PyObject* found = PyObject_Call(PyTuple_GET_ITEM(condition, 0), PyTuple_GET_ITEM(condition, 1), NULL);
    if (found == NULL) return NULL;
    PyObject* value = PyTuple_GET_ITEM(condition, 2);
    int equal = found == value ? 1 : PyObject_RichCompareBool(found, value, Py_EQ);
    Py_DECREF(found);
    if (equal < 0) return NULL;
    if (!equal) return PyLong_FromLong(2);
  }
  for (Py_ssize_t i = 1; i < n; i++) {
    if (Py_TYPE(args[i]) != tensor_type) {
      PyErr_SetString(PyExc_TypeError, "eager_state takes torch.Tensor arguments");
      return NULL;
    }
  }
  int grad = records_grad(args + 1, n - 1);
  if (grad < 0) return NULL;
  return PyLong_FromLong(grad);
}

static PyObject* limit(PyObject* module, PyObject* value) {
  long count = PyLong_AsLong(value);
  if (count == -1 && PyErr_Occurred()) return NULL;
  if (threads_limit != NULL) threads_limit((int)count);
  Py_RETURN_NONE;
}

static PyObject* bind_limit(PyObject* module, PyObject* value) {
  void* address = PyLong_AsVoidPtr(value);
  if (address == NULL && PyErr_Occurred()) return NULL;
  threads_limit = (ThreadsLimit)address;
  Py_RETURN_NONE;
}

/* init(torch.Tensor, its DLPack exchange capsule, torch.is_grad_enabled, requires_grad's
 * descriptor, TVMFFIFunctionCall, TVMFFIErrorMoveFromRaised, TVMFFIObjectDecRef) */
static PyObject* init(PyObject* module, PyObject* args) {
  PyObject *type, *capsule, *grad_enabled, *descriptor;
  unsigned long long call, move, decref;
  if (!PyArg_ParseTuple(args, "O!OOOKKK", &PyType_Type, &type, &capsule, &grad_enabled, &descriptor, &call, &move,
                        &decref))
    return NULL;
  const DLPackExchangeAPI* table = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
  if (table == NULL) return NULL;
  if (table->header.version.major != DLPACK_MAJOR_VERSION || table->dltensor_from_py_object_no_sync == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "torch's DLPack exchange table is of another version");
    return NULL;
  }
  if (!Py_IS_TYPE(descriptor, &PyGetSetDescr_Type)) {
    PyErr_SetString(PyExc_TypeError, "requires_grad is not a getset descriptor");
    return NULL;
  }
  PyGetSetDef* getset = ((PyGetSetDescrObject*)descriptor)->d_getset;
  Py_INCREF(type);
  Py_INCREF(grad_enabled);
  Py_INCREF(descriptor);  /* (its getset table lives as long as it) */
  tensor_type = (PyTypeObject*)type;
  is_grad_enabled = grad_enabled;
  requires_grad_get = getset->get;
  requires_grad_closure = getset->closure;
  function_call = (FunctionCall)(uintptr_t)call;
  error_move_from_raised = (ErrorMoveFromRaised)(uintptr_t)move;
  object_dec_ref = (ObjectDecRef)(uintptr_t)decref;
  api = table;
  Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"eager_state", (PyCFunction)(void (*)(void))eager_state, METH_FASTCALL,
     "eager_state(conditions, *tensors): 2 where a condition fails, else whether autograd records the call"},
    {"meta_key", (PyCFunction)(void (*)(void))meta_key, METH_FASTCALL,
     "meta_key(*tensors): dtype, device, shape and strides of each, as one tuple (None: not plain strided tensors)"},
    {"init", init, METH_VARARGS, "bind torch's and tvm-ffi's C entry points"},
    {"limit", limit, METH_O, "limit(n): at most n threads for this thread's next kernel launches"},
    {"bind_limit", bind_limit, METH_O, "bind_limit(address): the thread shim's limit function (0: none)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tvmflash_launch", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit_tvmflash_launch(void) {
  if (PyType_Ready(&LaunchType) < 0) return NULL;
  PyObject* m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  Py_INCREF(&LaunchType);
  if (PyModule_AddObject(m, "Launch", (PyObject*)&LaunchType) < 0) {
    Py_DECREF(&LaunchType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
