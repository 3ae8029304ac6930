"""Online adaptation of the draft (EvoSpec's third part): the target's verification signal, a replay buffer with a
curriculum, LoRA or full-parameter learners trained in a background worker, versions swapped in between steps."""
from evospec.adapt.learner import Learner, build_learner
from evospec.adapt.signal import TeacherSignal, teacher_signal

__all__ = ["Learner", "TeacherSignal", "build_learner", "teacher_signal"]
